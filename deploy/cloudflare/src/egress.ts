/**
 * A job's network policy, as the Sandbox SDK can enforce it (developers.cloudflare.com/
 * sandbox/guides/outbound-traffic/). Off unless asked for:
 *
 * - `[]` (the default): no network; the sandbox class has `enableInternet = false` and no
 *   allowed hosts, so nothing leaves the container.
 * - `["*"]`: the public internet (`enableInternet` turned on for this one sandbox).
 * - host names (`api.example.com`, `*.example.com`) and IPv4 addresses: `allowedHosts`,
 *   deny-by-default, HTTP and HTTPS (ports 80 and 443) only, HTTPS through Cloudflare's
 *   interception so the host name is checked.
 *
 * What the SDK cannot express (CIDR ranges, IPv6 literals, ports) is refused with 422,
 * never widened to something it can.
 */

import { HttpError } from "./http";

export type Egress =
  | { kind: "none" }
  | { kind: "open" }
  | { kind: "hosts"; hosts: string[] };

const LABEL = "[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?";
const HOST = new RegExp(`^(?:\\*\\.)?(?:${LABEL}\\.)*${LABEL}$`);

export function egressOf(entries: readonly string[]): Egress {
  if (entries.length === 0) return { kind: "none" };
  if (entries.includes("*")) return { kind: "open" };
  const hosts = entries.map((entry) => entry.toLowerCase());
  const unsupported = hosts.filter((host) => host.length > 253 || !HOST.test(host));
  if (unsupported.length > 0) {
    throw new HttpError(
      422,
      "egress_unsupported",
      `Cloudflare's outbound rules take host names and IPv4 addresses, not ${JSON.stringify(unsupported[0])} ` +
        "(CIDR ranges, IPv6 literals and ports cannot be enforced)",
    );
  }
  return { kind: "hosts", hosts: [...new Set(hosts)] };
}
