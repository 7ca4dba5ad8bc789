// relay console: reads the JSON API with the admin token kept in this tab's sessionStorage,
// sent as the relay's auth header (never in a URL or a cookie). Data goes into the page as
// text nodes and SVG attributes only, never as HTML, so a run's output or params cannot
// become markup. No build step, no library: the Content-Security-Policy allows this file only.
"use strict";

(() => {
  const KEY = "relay-console-token";
  const SVG = "http://www.w3.org/2000/svg";
  const FINAL = new Set(["succeeded", "failed", "timed_out", "canceled", "error", "lost"]);
  const PERIODS = { "1h": 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400 };
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
      headers: { [header]: auth },
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
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
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

  function duration(run) {
    let ms = run.duration_ms;
    if (ms === null || ms === undefined) {
      if (FINAL.has(run.state)) return "";
      ms = Date.now() - Date.parse(run.created_at);
    }
    return ms < 1000 ? ms + " ms" : (ms / 1000).toFixed(1) + " s";
  }

  function facts(list, pairs) {
    list.replaceChildren();
    for (const [name, value] of pairs) {
      if (value === null || value === undefined || value === "") continue;
      list.append(el("dt", {}, name), el("dd", {}, value));
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
    return el(
      "tr",
      { "data-run-id": run.id },
      el("td", {}, link),
      el("td", {}, badge(run.state)),
      el("td", {}, run.job === null ? "(command)" : run.job),
      el("td", {}, run.token || ""),
      el("td", {}, run.provider),
      el("td", {}, when(run.created_at)),
      el("td", { class: "number" }, duration(run)),
      el("td", { class: "number" }, usd(run.cost_usd)),
    );
  }

  async function runsPage() {
    const shown = new URLSearchParams(location.search);
    const form = $("filters");
    for (const [name, value] of shown) if (form.elements[name]) form.elements[name].value = value;
    const query = new URLSearchParams({ limit: "100" });
    for (const [name, field] of [["state", "state"], ["job", "job"], ["token_name", "token"], ["provider", "provider"]]) {
      const value = shown.get(name);
      if (value) query.set(field, value);
    }
    const period = PERIODS[shown.get("period")];
    if (period) query.set("since", new Date(Date.now() - period * 1000).toISOString());
    const draw = async () => {
      const page = await json("/v1/runs?" + query);
      $("runs").tBodies[0].replaceChildren(...page.runs.map(runRow));
      $("runs-empty").hidden = page.runs.length > 0;
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

  function drawRun(run, withOutput) {
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
      ["duration", duration(run)],
      ["cost", usd(run.cost_usd)],
      ["exit code", run.exit_code === null ? null : String(run.exit_code)],
      ["error", run.error ? run.error.code + ": " + run.error.message : null],
    ]);
    facts($("run-request"), requestFacts(run.request));
    $("timings").replaceChildren(timingsBar(run.timings || {}));
    if (withOutput) {
      $("stdout").textContent = run.stdout;
      $("stderr").textContent = run.stderr;
    }
  }

  function setState(state) {
    $("run-state").replaceWith(Object.assign(badge(state), { id: "run-state" }));
    $("cancel").hidden = FINAL.has(state);
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

  async function healthPage() {
    const health = await json("/v1/health");
    $("health-status").replaceWith(Object.assign(badge(health.status), { id: "health-status" }));
    $("active-runs").textContent = String(health.active_runs);
    facts($("checks"), Object.entries(health.checks));
    $("providers").tBodies[0].replaceChildren(
      ...health.providers.map((provider) => el("tr", {},
        el("th", { scope: "row" }, provider.name),
        el("td", {}, provider.problem || "none"),
        el("td", { class: "number" }, String(provider.runs)),
        el("td", { class: "number" }, String(provider.errors)),
        el("td", { class: "number" }, provider.runs ? Math.round((provider.errors / provider.runs) * 100) + "%" : "–"))),
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
    facts($("pools"), pools.size || pools.created ? [
      ["ready / wanted", pools.ready + " / " + pools.size],
      ["created", String(pools.created)],
      ["claimed by runs", String(pools.claimed)],
      ["expired idle", String(pools.expired)],
      ["failed creates", String(pools.failed)],
      ["idle time", pools.idle_seconds.toFixed(1) + " s ($" + pools.idle_usd.toFixed(4) + ")"],
    ] : [["pools", "none (no job sets warm)"]]);
  }

  // -- start -------------------------------------------------------------------------

  const PAGES = { runs: runsPage, run: runPage, spend: spendPage, health: healthPage };

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
