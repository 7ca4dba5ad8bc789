// relay console: reads the JSON API with the admin token kept in this tab's sessionStorage,
// sent as the relay's auth header (never in a URL or a cookie). Data goes into the page as
// text nodes and SVG attributes only, never as HTML, so a run's output or params cannot
// become markup. No build step, no library: the Content-Security-Policy allows this file only.
"use strict";

(() => {
  const KEY = "relay-console-token";
  const SVG = "http://www.w3.org/2000/svg";
  const FINAL = new Set(["succeeded", "failed", "timed_out", "canceled", "error", "lost"]);
  const FAILURES = "failed,timed_out,error,lost";
  const PERIODS = { "1h": 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400 };
  const PERIOD_OF_HOURS = { 1: "1h", 24: "24h", 168: "7d", 720: "30d" };
  const PAGE_SIZE = "100";
  const PALETTE = ["#0b5cad", "#d1242f", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#bf3989", "#6e7781"];
  const header = document.querySelector('meta[name="relay-auth-header"]').content;
  const $ = (id) => document.getElementById(id);

  class ApiError extends Error {
    constructor(status, body) {
      super((body && body.error && body.error.message) || "HTTP " + status);
      this.status = status;
    }
  }

  function token() {
    return sessionStorage.getItem(KEY);
  }

  async function api(path, options = {}) {
    const value = token();
    const auth = header.toLowerCase() === "authorization" ? "Bearer " + value : value;
    const answer = await fetch(path, {
      ...options,
      headers: { ...(options.headers || {}), [header]: auth },
      credentials: "omit",
      cache: "no-store",
    });
    if (!answer.ok) {
      let body = null;
      try {
        body = await answer.json();
      } catch (ignored) {
        body = null;
      }
      throw new ApiError(answer.status, body);
    }
    return answer;
  }

  async function json(path, options) {
    return (await api(path, options)).json();
  }

  // An element with attributes and children (strings become text nodes, never HTML).
  function el(tag, attributes = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes)) {
      if (value !== null && value !== undefined) node.setAttribute(name, value);
    }
    node.append(...children.filter((child) => child !== null && child !== undefined));
    return node;
  }

  function svg(tag, attributes = {}, ...children) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
    node.append(...children);
    return node;
  }

  function badge(state) {
    return el("span", { class: "state state-" + state }, state);
  }

  function usd(value) {
    return "$" + Number(value || 0).toFixed(4);
  }

  function when(iso) {
    return iso ? iso.replace("T", " ").replace(/\.\d+Z$|Z$/, " UTC") : "";
  }

  function age(iso) {
    const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (seconds < 60) return Math.floor(seconds) + " s ago";
    if (seconds < 3600) return Math.floor(seconds / 60) + " min ago";
    if (seconds < 86400) return Math.floor(seconds / 3600) + " h ago";
    return Math.floor(seconds / 86400) + " d ago";
  }

  function millis(value) {
    if (value === null || value === undefined) return "–";
    return value < 1000 ? value + " ms" : (value / 1000).toFixed(1) + " s";
  }

  // A finished run's duration, or a live one's so far (counted from its start).
  function duration(run) {
    let ms = run.duration_ms;
    if (ms === null || ms === undefined) {
      if (FINAL.has(run.state)) return "";
      ms = Math.max(0, Date.now() - Date.parse(run.started_at || run.created_at));
    }
    return millis(Math.round(ms));
  }

  // How a run ended, in a few words: its error code, its exit code, a timeout.
  function ending(run) {
    const words = [];
    if (run.error) words.push(run.error.code);
    if (run.exit_code !== null && run.exit_code !== undefined) words.push("exit " + run.exit_code);
    else if (run.state === "timed_out" && !run.error) words.push("timed out");
    return words.join(" · ");
  }

  // What a run was asked, in one line: its params, or its command.
  function asked(request) {
    if (!request) return "";
    if (request.command) return JSON.stringify(request.command);
    return Object.keys(request.params || {}).length ? JSON.stringify(request.params) : "";
  }

  function clip(text, most) {
    return text.length > most ? text.slice(0, most - 1) + "…" : text;
  }

  // A list of terms and their values; a pair may name the id of its value's element.
  function facts(list, pairs) {
    list.replaceChildren();
    for (const [name, value, id] of pairs) {
      if (value === null || value === undefined || value === "") continue;
      list.append(el("dt", {}, name), el("dd", { id }, value));
    }
  }

  function say(text) {
    const message = $("message");
    message.textContent = text;
    message.hidden = !text;
  }

  function showLogin() {
    $("content").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("token-input").focus();
  }

  function failed(error) {
    if (error instanceof ApiError && (error.status === 401 || error.status === 403)) {
      sessionStorage.removeItem(KEY);
      say(
        error.status === 403
          ? "Refused: this token is not an admin token. The console needs one (relay tokens new NAME --admin)."
          : "Refused: the relay does not know this token.",
      );
      showLogin();
      return;
    }
    say("Error: " + error.message);
  }

  // -- runs --------------------------------------------------------------------------

  function runRow(run) {
    const link = el("a", { href: "/console/runs/" + encodeURIComponent(run.id) }, run.id);
    const request = asked(run.request);
    return el(
      "tr",
      { "data-run-id": run.id },
      el("td", { class: "cell-id" }, link),
      el("td", { class: "cell-state" }, badge(run.state)),
      el("td", { class: "cell-job" }, run.job === null ? "(command)" : run.job),
      el("td", { class: "cell-asked", title: request.length > 48 ? request : null }, clip(request, 48)),
      el("td", { class: "cell-ending", title: run.error ? run.error.message : null }, ending(run)),
      el("td", { class: "cell-token" }, run.token || ""),
      el("td", { class: "cell-provider" }, run.provider),
      el("td", { class: "cell-age" }, el("time", { datetime: run.created_at, title: when(run.created_at) }, age(run.created_at))),
      el("td", { class: "number cell-duration" }, duration(run)),
      el("td", { class: "number cell-cost" }, usd(run.cost_usd)),
    );
  }

  function consoleUrl(query) {
    const text = query.toString();
    return "/console" + (text ? "?" + text : "");
  }

  async function runsPage() {
    const shown = new URLSearchParams(location.search);
    const form = $("filters");
    for (const [name, value] of shown) {
      const field = form.elements[name];
      if (!field) continue;
      if (field.tagName === "SELECT" && ![...field.options].some((option) => option.value === value)) {
        field.append(el("option", { value }, value)); // a state list made elsewhere (the jobs page)
      }
      field.value = value;
    }
    const limit = /^[0-9]{1,3}$/.test(shown.get("limit") || "") ? shown.get("limit") : PAGE_SIZE;
    const query = new URLSearchParams({ limit });
    for (const [name, field] of [["q", "q"], ["state", "state"], ["job", "job"], ["token_name", "token"], ["provider", "provider"], ["cursor", "cursor"]]) {
      const value = shown.get(name);
      if (value) query.set(field, value);
    }
    const period = PERIODS[shown.get("period")];
    if (period) query.set("since", new Date(Date.now() - period * 1000).toISOString());
    const first = new URLSearchParams(shown);
    first.delete("cursor");
    $("newest").href = consoleUrl(first);
    $("newest").hidden = !shown.get("cursor");
    if (shown.get("cursor")) $("runs-caption").textContent = "Older runs, newest first; refreshed every few seconds";
    const draw = async () => {
      const page = await json("/v1/runs?" + query);
      $("runs").tBodies[0].replaceChildren(...page.runs.map(runRow));
      $("runs-empty").hidden = page.runs.length > 0;
      const older = $("older");
      older.hidden = !page.next_cursor;
      if (page.next_cursor) {
        const next = new URLSearchParams(shown);
        next.set("cursor", page.next_cursor);
        older.href = consoleUrl(next);
      }
    };
    await draw();
    const timer = setInterval(() => draw().catch((error) => {
      clearInterval(timer);
      failed(error);
    }), 2000);
  }

  // -- one run -----------------------------------------------------------------------

  function timingsBar(timings) {
    const steps = [
      ["create", timings.create_ms, "#8250df"],
      ["exec", timings.exec_ms, "#0b5cad"],
      ["terminate", timings.terminate_ms, "#6e7781"],
    ].filter(([, ms]) => ms !== null && ms !== undefined);
    const total = steps.reduce((sum, [, ms]) => sum + ms, 0);
    const words = steps.map(([name, ms]) => name + " " + ms + " ms");
    if (timings.first_output_ms !== null && timings.first_output_ms !== undefined) {
      words.splice(1, 0, "first output " + timings.first_output_ms + " ms");
    }
    const label = words.join(" · ") || "no timings yet";
    if (!total) return el("p", {}, label);
    const chart = svg("svg", { viewBox: "0 0 600 24", role: "img", "aria-label": label, width: 600, height: 24 });
    let x = 0;
    for (const [name, ms, colour] of steps) {
      const width = Math.max(1, (ms / total) * 600);
      chart.append(svg("rect", { x, y: 0, width, height: 24, fill: colour }, svg("title", {}, name + " " + ms + " ms")));
      x += width;
    }
    if (timings.first_output_ms !== null && timings.first_output_ms !== undefined && timings.create_ms !== null) {
      const at = ((timings.create_ms + timings.first_output_ms) / total) * 600;
      chart.append(svg("line", { x1: at, x2: at, y1: 0, y2: 24, stroke: "#f0b400", "stroke-width": 3 }));
    }
    return el("figure", { class: "chart" }, chart, el("figcaption", {}, label));
  }

  function requestFacts(asked) {
    if (!asked) return [["request", "not recorded (a run older than this relay version)"]];
    return [
      ["job", asked.job],
      ["params", Object.keys(asked.params || {}).length ? JSON.stringify(asked.params, null, 1) : null],
      ["command", asked.command ? JSON.stringify(asked.command) : null],
      ["provider", asked.provider],
      ["image", asked.image],
      ["size", asked.size ? JSON.stringify(asked.size) : null],
      ["env", asked.env.length ? asked.env.map((name) => name + "=(hidden)").join(" ") : null],
      ["files", asked.files.length ? asked.files.join(", ") : null],
      ["stdin", asked.stdin_bytes ? asked.stdin_bytes + " bytes (not shown)" : null],
      ["workdir", asked.workdir],
      ["timeout", asked.timeout_s === null ? null : asked.timeout_s + " s"],
      ["egress", asked.egress ? JSON.stringify(asked.egress) : null],
      ["wait", String(asked.wait)],
    ];
  }

  let shownRun = null; // the run as last drawn: its duration counts on while it is live

  function drawRun(run, withOutput) {
    shownRun = run;
    $("run-state").replaceWith(Object.assign(badge(run.state), { id: "run-state" }));
    $("cancel").hidden = FINAL.has(run.state);
    facts($("run-facts"), [
      ["token", run.token],
      ["job", run.job === null ? "(command)" : run.job],
      ["provider", run.provider],
      ["sandbox", run.sandbox_id],
      ["created", when(run.created_at)],
      ["started", when(run.started_at)],
      ["ended", when(run.ended_at)],
      ["duration", duration(run), "run-duration"],
      ["cost", usd(run.cost_usd)],
      ["exit code", run.exit_code === null ? null : String(run.exit_code)],
      ["error", run.error ? run.error.code + ": " + run.error.message : null],
    ]);
    facts($("run-request"), requestFacts(run.request));
    $("timings").replaceChildren(timingsBar(run.timings || {}));
    drawAttempts(run.attempts || []);
    drawDeliveries(run.deliveries || []);
    drawArtifacts(run.artifacts || []);
    if (withOutput) {
      $("stdout").textContent = run.stdout;
      $("stderr").textContent = run.stderr;
    }
  }

  function setState(state) {
    if (shownRun) shownRun = { ...shownRun, state };
    $("run-state").replaceWith(Object.assign(badge(state), { id: "run-state" }));
    $("cancel").hidden = FINAL.has(state);
  }

  function drawAttempts(attempts) {
    $("attempts").tBodies[0].replaceChildren(
      ...attempts.map((attempt, index) => el(
        "tr",
        { "data-provider": attempt.provider },
        el("td", { class: "number" }, String(index + 1)),
        el("td", {}, attempt.provider),
        el("td", {}, attempt.sandbox_id ? el("code", {}, attempt.sandbox_id) : "–"),
        el("td", { class: "number" }, millis(attempt.create_ms)),
        el("td", {}, when(attempt.ended_at) || "–"),
        el("td", {}, attempt.error ? attempt.error.code + ": " + attempt.error.message : "–"),
      )),
    );
  }

  const PREVIEW_IMAGES = new Set(["image/png", "image/jpeg", "image/gif", "image/webp"]);
  const PREVIEW_TEXT_BYTES = 65536;
  let drawnArtifacts = "";

  // A run's artifacts: each kept one downloaded or previewed through the API with the
  // token (a plain link would carry none), as a blob; names and reasons as text only.
  function drawArtifacts(artifacts) {
    const key = JSON.stringify(artifacts);
    if (key === drawnArtifacts) return; // redrawn each poll: keep an open preview
    drawnArtifacts = key;
    $("artifacts-none").hidden = artifacts.length > 0;
    $("artifacts").hidden = artifacts.length === 0;
    $("artifacts").tBodies[0].replaceChildren(...artifacts.map((entry) => el(
      "tr",
      {},
      el("td", {}, el("code", {}, entry.name)),
      el("td", { class: "number" }, entry.sha256 ? String(entry.size) : "–"),
      el("td", {}, entry.content_type),
      el("td", {}, ...artifactActions(entry)),
    )));
  }

  function artifactActions(entry) {
    if (!entry.sha256 || typeof entry.url !== "string" || !entry.url.startsWith("/v1/runs/")) {
      return ["not kept: " + (entry.skipped || "skipped")];
    }
    const actions = [button("Download", () => downloadArtifact(entry))];
    const text = entry.content_type.startsWith("text/") || entry.content_type === "application/json";
    if (PREVIEW_IMAGES.has(entry.content_type) || (text && entry.size <= PREVIEW_TEXT_BYTES)) {
      actions.push(" ", button("Preview", () => previewArtifact(entry, text)));
    }
    if (entry.truncated) actions.push(" (truncated: " + (entry.truncated_by || "a cap") + ")");
    return actions;
  }

  function button(label, action) {
    const node = el("button", { type: "button" }, label);
    node.addEventListener("click", () => action().catch((error) => {
      $("artifact-preview").replaceChildren(el("p", { role: "alert" }, "Could not fetch it: " + error.message));
    }));
    return node;
  }

  async function downloadArtifact(entry) {
    const blob = await (await api(entry.url)).blob();
    const link = el("a", { href: URL.createObjectURL(blob), download: entry.name.split("/").pop() });
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 60000);
  }

  async function previewArtifact(entry, text) {
    const answer = await api(entry.url);
    const shown = text
      ? el("pre", { class: "output" }, await answer.text())
      : el("img", { src: URL.createObjectURL(await answer.blob()), alt: entry.name });
    $("artifact-preview").replaceChildren(el("h3", {}, entry.name), shown);
  }

  function drawDeliveries(deliveries) {
    $("deliveries-none").hidden = deliveries.length > 0;
    $("deliveries").hidden = deliveries.length === 0;
    $("deliveries").tBodies[0].replaceChildren(
      ...deliveries.map((delivery) => el(
        "tr",
        { "data-delivery-id": delivery.id },
        el("td", {}, el("code", {}, delivery.id)),
        el("td", {}, badge(delivery.state)),
        el("td", { class: "number" }, String(delivery.attempts.length)),
        el("td", {}, delivery.next_attempt_at ? when(delivery.next_attempt_at) : "–"),
        el("td", {}, delivery.attempts.length ? el("ol", { class: "attempts" }, ...delivery.attempts.map((attempt) => el(
          "li",
          { value: String(attempt.attempt) },
          [
            when(attempt.at),
            attempt.status_code !== null && attempt.status_code !== undefined ? "HTTP " + attempt.status_code : attempt.error,
            attempt.duration_ms !== null && attempt.duration_ms !== undefined ? attempt.duration_ms + " ms" : null,
          ].filter(Boolean).join(" · "),
        ))) : "none yet"),
      )),
    );
  }

  // The body of POST /v1/runs that asks again what a run's request (its echo) asked, or
  // why it cannot be rebuilt: the relay keeps env values, file contents and stdin nowhere.
  function rebuilt(request) {
    if (!request) return { why: "Its request was not recorded (a run older than this relay version), so it cannot be rebuilt here." };
    const missing = [];
    if (request.env.length) missing.push("the values of its env (" + request.env.join(", ") + ")");
    if (request.files.length) missing.push("the contents of its files (" + request.files.join(", ") + ")");
    if (request.stdin_bytes) missing.push("its stdin (" + request.stdin_bytes + " bytes)");
    if (missing.length) {
      return { why: "It cannot be re-run from here: the relay does not keep " + missing.join(", ") + ", which may be secrets. Submit it again from where it came from." };
    }
    const body = { wait: false };
    for (const name of ["job", "command", "image", "size", "workdir", "timeout_s", "egress"]) {
      if (request[name] !== null && request[name] !== undefined) body[name] = request[name];
    }
    if (Object.keys(request.params || {}).length) body.params = request.params;
    if (request.provider && request.provider !== "auto") body.provider = request.provider;
    return { body };
  }

  function offerRerun(run) {
    const { body, why } = rebuilt(run.request);
    const button = $("rerun");
    button.hidden = !body;
    if (!body) {
      $("rerun-note").textContent = why;
      return;
    }
    $("rerun-note").textContent =
      "Submits the same request again through POST /v1/runs as the admin token you logged in with: " +
      "the new run is that token's (its scopes and limits apply), not " + (run.token || "the original token") + "'s, " +
      "and it has no callback URL (the relay does not keep one).";
    button.addEventListener("click", async () => {
      button.disabled = true;
      $("rerun-result").textContent = "Submitting…";
      try {
        const again = await json("/v1/runs", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify(body),
        });
        location.assign("/console/runs/" + encodeURIComponent(again.id));
      } catch (error) {
        if (error instanceof ApiError && error.status === 401) {
          failed(error);
          return;
        }
        $("rerun-result").textContent = "Refused: " + error.message;
        button.disabled = false;
      }
    });
  }

  async function follow(id) {
    const answer = await api("/v1/runs/" + encodeURIComponent(id) + "/events");
    const reader = answer.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let cut = buffer.indexOf("\n");
      while (cut >= 0) {
        const line = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 1);
        cut = buffer.indexOf("\n");
        if (!line) continue;
        const event = JSON.parse(line);
        if (event.event === "output") $(event.stream).append(event.text);
        else if (event.event === "state") setState(event.state);
        else if (event.event === "run") drawRun(event.run, true);
      }
    }
  }

  async function runPage() {
    const id = document.body.dataset.runId;
    const run = await json("/v1/runs/" + encodeURIComponent(id));
    const live = !FINAL.has(run.state);
    drawRun(run, !live); // a live run's output comes whole from the start of its events
    offerRerun(run);
    setInterval(() => {
      if (!shownRun || FINAL.has(shownRun.state)) return;
      const shown = $("run-duration");
      if (shown) shown.textContent = duration(shownRun);
    }, 1000);
    $("cancel").addEventListener("click", async () => {
      $("cancel").disabled = true;
      try {
        drawRun(await json("/v1/runs/" + encodeURIComponent(id), { method: "DELETE" }), false);
      } catch (error) {
        failed(error);
      } finally {
        $("cancel").disabled = false;
      }
    });
    if (live) follow(id).catch(failed);
  }

  // -- jobs ------------------------------------------------------------------------

  function outcomeRow(group, field, period) {
    const filtered = (extra) => {
      const query = new URLSearchParams({ [field]: group.name, period, ...extra });
      return consoleUrl(query);
    };
    const named = group.name !== null; // raw-command runs have no job to filter on
    const ended = group.succeeded + group.failed;
    const last = group.last_failure;
    return el(
      "tr",
      { "data-name": group.name === null ? "" : group.name },
      el("th", { scope: "row" }, named ? el("a", { href: filtered({}) }, group.name) : "(command)"),
      el("td", { class: "number" }, String(group.runs) + (group.active ? ` (${group.active} active)` : "")),
      el("td", { class: "number", title: ended ? `${group.succeeded} of ${ended}` : null },
        group.success_rate === null ? "–" : Math.round(group.success_rate * 100) + "%"),
      el("td", { class: "number" }, group.failed && named ? el("a", { href: filtered({ state: FAILURES }) }, String(group.failed)) : String(group.failed)),
      el("td", {}, Object.keys(group.failures).length
        ? el("ul", { class: "causes" }, ...Object.entries(group.failures).map(([cause, count]) => el("li", {}, `${cause} × ${count}`)))
        : "–"),
      el("td", { class: "number" }, millis(group.p50_ms)),
      el("td", { class: "number" }, millis(group.p95_ms)),
      el("td", { class: "number" }, usd(group.usd)),
      el("td", { title: last && last.error ? last.error.message : null }, last
        ? el("a", { href: "/console/runs/" + encodeURIComponent(last.run_id) }, `${ending(last) || last.state}, ${age(last.created_at)}`)
        : "–"),
    );
  }

  async function jobsPage() {
    const shown = new URLSearchParams(location.search);
    const hours = PERIOD_OF_HOURS[shown.get("hours")] ? shown.get("hours") : "24";
    $("window").elements.hours.value = hours;
    const report = await json("/v1/outcomes?hours=" + hours);
    const period = PERIOD_OF_HOURS[hours];
    $("outcomes-window").textContent = `Every token's runs created from ${when(report.since)} to ${when(report.until)}.`;
    $("jobs").tBodies[0].replaceChildren(...report.jobs.map((group) => outcomeRow(group, "job", period)));
    $("job-providers").tBodies[0].replaceChildren(...report.providers.map((group) => outcomeRow(group, "provider", period)));
    $("jobs-omitted").hidden = !report.omitted;
    $("jobs-omitted").textContent = `${report.omitted} less busy jobs are left out.`;
  }

  // -- spend -------------------------------------------------------------------------

  function stackedBars(days, rows, series, field, title, format) {
    const width = 720, height = 220, left = 64, right = 24, bottom = 24, top = 8;
    const perDay = new Map(days.map((day) => [day, new Map()]));
    for (const row of rows) {
      const key = row.token + " · " + row.provider;
      const day = perDay.get(row.day);
      if (day) day.set(key, (day.get(key) || 0) + row[field]);
    }
    const totals = days.map((day) => [...perDay.get(day).values()].reduce((a, b) => a + b, 0));
    const most = Math.max(...totals, 0) || 1;
    const total = totals.reduce((a, b) => a + b, 0);
    const chart = svg("svg", {
      viewBox: `0 0 ${width} ${height}`,
      role: "img",
      "aria-label": `${title}: ${format(total)} in all over ${days.length} days`,
      "data-total": String(total),
    });
    const scale = (height - bottom - top) / most;
    const slot = (width - left - right) / days.length;
    for (const [mark, y] of [[most, top], [most / 2, top + (height - bottom - top) / 2], [0, height - bottom]]) {
      chart.append(svg("line", { x1: left, x2: width - right, y1: y, y2: y, stroke: "#d0d7de" }));
      chart.append(svg("text", { x: left - 6, y: y + 4, "text-anchor": "end", "font-size": 11, fill: "#57606a" }, format(mark)));
    }
    days.forEach((day, index) => {
      let y = height - bottom;
      const x = left + index * slot + 1;
      for (const [position, key] of series.entries()) {
        const value = perDay.get(day).get(key) || 0;
        if (!value) continue;
        const tall = Math.max(1, value * scale);
        y -= tall;
        chart.append(svg("rect", { x, y, width: Math.max(1, slot - 2), height: tall, fill: PALETTE[position % PALETTE.length] },
          svg("title", {}, `${day} ${key}: ${format(value)}`)));
      }
      if ((days.length - 1 - index) % 7 === 0) {
        chart.append(svg("text", { x: x + slot / 2, y: height - 6, "text-anchor": "middle", "font-size": 11, fill: "#57606a" }, day.slice(5)));
      }
    });
    return chart;
  }

  function closeness(used, limit, format) {
    if (limit === null || limit === undefined) return el("td", {}, format(used) + " (no limit)");
    const part = Math.round((used / limit) * 100);
    return el(
      "td",
      {},
      el("meter", { min: "0", max: String(limit), value: String(Math.min(used, limit)), high: String(limit * 0.8), "aria-label": part + "% of the limit" }),
      ` ${format(used)} / ${format(limit)} (${part}%)`,
    );
  }

  async function spendPage() {
    const report = await json("/v1/spend?days=30");
    const first = Date.parse(report.since + "T00:00:00Z");
    const days = [];
    for (let index = 0; index < report.days; index++) days.push(new Date(first + index * 86400000).toISOString().slice(0, 10));
    const series = [...new Set(report.rows.map((row) => row.token + " · " + row.provider))].sort();
    const count = (value) => (Number.isInteger(value) ? String(value) : value.toFixed(1));
    $("usd-chart").replaceChildren(stackedBars(days, report.rows, series, "usd", "USD per day", usd));
    $("runs-chart").replaceChildren(stackedBars(days, report.rows, series, "runs", "Runs per day", count));
    $("legend").replaceChildren(...series.map((key, position) => el("li", {},
      svg("svg", { width: 12, height: 12, "aria-hidden": "true" }, svg("rect", { width: 12, height: 12, fill: PALETTE[position % PALETTE.length] })),
      key)));
    const sums = new Map();
    for (const row of report.rows) {
      const key = row.token + " · " + row.provider;
      const sum = sums.get(key) || { token: row.token, provider: row.provider, runs: 0, usd: 0 };
      sum.runs += row.runs;
      sum.usd += row.usd;
      sums.set(key, sum);
    }
    const all = [...sums.values()];
    const runs = all.reduce((a, sum) => a + sum.runs, 0);
    const spent = all.reduce((a, sum) => a + sum.usd, 0);
    $("spend-total").textContent = `${runs} runs, ${usd(spent)} over ${report.days} days (UTC, from ${report.since})`;
    $("spend-totals").tBodies[0].replaceChildren(
      ...series.map((key) => {
        const sum = sums.get(key);
        return el("tr", {}, el("td", {}, sum.token), el("td", {}, sum.provider),
          el("td", { class: "number" }, String(sum.runs)), el("td", { class: "number" }, usd(sum.usd)));
      }),
    );
    $("limits").tBodies[0].replaceChildren(
      ...report.tokens.map((entry) => el("tr", {},
        el("th", { scope: "row" }, entry.token + (entry.admin ? " (admin)" : "")),
        closeness(entry.today.runs, entry.limits.runs_per_day, count),
        closeness(entry.today.usd, entry.limits.usd_per_day, usd),
        closeness(entry.today.active, entry.limits.max_concurrent, count))),
    );
  }

  // -- health ------------------------------------------------------------------------

  function breakerText(breaker) {
    if (!breaker) return "–";
    const failures = breaker.consecutive_failures ? ", " + breaker.consecutive_failures + " failed in a row" : "";
    if (breaker.state === "open") return "open (one run tries it in " + Math.ceil(breaker.cooldown_left_s) + " s)" + failures;
    if (breaker.state === "half_open") return "half-open (the next run tries it)";
    return "closed" + failures;
  }

  async function healthPage() {
    const health = await json("/v1/health");
    $("health-status").replaceWith(Object.assign(badge(health.status), { id: "health-status" }));
    $("active-runs").textContent = String(health.active_runs);
    facts($("checks"), Object.entries(health.checks));
    $("providers").tBodies[0].replaceChildren(
      ...health.providers.map((provider) => el("tr", {},
        el("th", { scope: "row" }, provider.name),
        el("td", {}, provider.problem || "none"),
        el("td", {}, breakerText(provider.breaker)),
        el("td", { class: "number" }, String(Object.values((provider.breaker || {}).failovers || {}).reduce((a, b) => a + b, 0))),
        el("td", { class: "number" }, provider.create_p50_ms == null ? "–" : provider.create_p50_ms + " ms"),
        el("td", { class: "number" }, provider.max_concurrent == null ? "none" : String(provider.max_concurrent)),
        el("td", { class: "number" }, String(provider.runs)),
        el("td", { class: "number" }, String(provider.failed)),
        el("td", { class: "number" }, String(provider.errors)),
        el("td", { class: "number" }, provider.runs ? Math.round((provider.failed / provider.runs) * 100) + "%" : "–"))),
    );
    const reaper = health.reaper;
    facts($("reaper"), reaper ? [
      ["last sweep", when(reaper.last_sweep_at) || "not yet"],
      ["sweeps", String(reaper.sweeps)],
      ["failing to terminate", String(reaper.failing)],
      ...Object.entries(reaper.terminated_by_reason).map(([reason, n]) => ["reaped: " + reason, String(n)]),
    ] : [["reaper", "not running here"]]);
    facts($("webhooks"), [
      ["pending deliveries", String(health.webhooks.pending)],
      ["oldest pending", when(health.webhooks.oldest_pending_at) || "none"],
    ]);
    const pools = health.pools;
    // A job's warm on a provider whose create is cheaper than a claim (local) keeps no pool.
    const skipped = (pools.skipped || []).map((skip) =>
      ["skipped: " + skip.job + " on " + skip.provider, skip.reason]);
    facts($("pools"), pools.size || pools.created ? [
      ["ready / wanted", pools.ready + " / " + pools.size],
      ["created", String(pools.created)],
      ["claimed by runs", String(pools.claimed)],
      ["expired idle", String(pools.expired)],
      ["failed creates", String(pools.failed)],
      ["idle time", pools.idle_seconds.toFixed(1) + " s ($" + pools.idle_usd.toFixed(4) + ")"],
      ...skipped,
    ] : skipped.length ? skipped : [["pools", "none (no job sets warm)"]]);
  }

  // -- start -------------------------------------------------------------------------

  const PAGES = { runs: runsPage, run: runPage, jobs: jobsPage, spend: spendPage, health: healthPage };

  async function start() {
    if (!token()) {
      showLogin();
      return;
    }
    try {
      await json("/v1/health"); // admin tokens only: anything else is refused here
    } catch (error) {
      failed(error);
      return;
    }
    say("");
    $("login").hidden = true;
    $("content").hidden = false;
    $("logout").hidden = false;
    try {
      await PAGES[document.body.dataset.page]();
      document.body.dataset.ready = "true";
    } catch (error) {
      failed(error);
    }
  }

  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = $("token-input");
    sessionStorage.setItem(KEY, input.value.trim());
    input.value = "";
    start();
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    say("");
    showLogin();
  });
  start();
})();
