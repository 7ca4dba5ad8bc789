/**
 * Sizes mapped to Cloudflare's instance types (developers.cloudflare.com/containers/
 * platform/limits/). An instance type belongs to a container application, not to one
 * container, so the Worker has one sandbox class per type (wrangler.jsonc binds each under
 * its class name); a job gets the smallest type that holds its size among those deployed,
 * and a size none holds is refused (422), never shrunk.
 */

import type { Env, SandboxBinding } from "./env";
import { HttpError } from "./http";

export interface Size {
  cpu: number;
  memory_mb: number;
  disk_mb: number;
}

export interface InstanceType extends Size {
  name: string;
  binding: SandboxBinding;
}

/** Disk is in GB (10^9 bytes) on the limits page, and in MiB here, rounded down. */
const gb = (count: number): number => Math.floor((count * 1e9) / 2 ** 20);

export const INSTANCE_TYPES: readonly InstanceType[] = [
  { name: "lite", binding: "SandboxLite", cpu: 1 / 16, memory_mb: 256, disk_mb: gb(2) },
  { name: "basic", binding: "SandboxBasic", cpu: 1 / 4, memory_mb: 1024, disk_mb: gb(4) },
  { name: "standard-1", binding: "SandboxStandard1", cpu: 1 / 2, memory_mb: 4096, disk_mb: gb(8) },
  { name: "standard-2", binding: "SandboxStandard2", cpu: 1, memory_mb: 6144, disk_mb: gb(12) },
  { name: "standard-3", binding: "SandboxStandard3", cpu: 2, memory_mb: 8192, disk_mb: gb(16) },
  { name: "standard-4", binding: "SandboxStandard4", cpu: 4, memory_mb: 12288, disk_mb: gb(20) },
];

export function instanceTypeNamed(name: string): InstanceType | undefined {
  return INSTANCE_TYPES.find((type) => type.name === name);
}

/** The smallest deployed instance type that holds `size` (the smallest deployed for none). */
export function instanceTypeFor(size: Size | null, env: Env): InstanceType {
  const deployed = INSTANCE_TYPES.filter((type) => env[type.binding] !== undefined);
  const fits = (type: InstanceType): boolean =>
    size === null ||
    (type.cpu >= size.cpu && type.memory_mb >= size.memory_mb && type.disk_mb >= size.disk_mb);
  const chosen = deployed.find(fits);
  if (chosen !== undefined) return chosen;
  const names = deployed.map((type) => type.name).join(", ") || "none";
  const wanted = size === null ? "any size" : `${size.cpu} vCPU, ${size.memory_mb} MiB memory, ${size.disk_mb} MiB disk`;
  const reason = INSTANCE_TYPES.some(fits)
    ? "no instance type deployed with this Worker holds"
    : "no Cloudflare instance type holds";
  throw new HttpError(422, "size_unsupported", `${reason} ${wanted} (deployed: ${names})`);
}
