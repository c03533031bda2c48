/* edgetrain dashboard: plain JavaScript, no framework, no build step.
 *
 * Views: "#/" (fleet and jobs) and "#/jobs/ID" (plan timeline, where the step goes,
 * loss, samples/s, utilisation). Data comes from /api/v1; live updates from /api/v1/events
 * (Server-Sent Events), or from polling when reads need a token (EventSource
 * cannot send an Authorization header).
 */
"use strict";

const API = "/api/v1";
const TOKEN_KEY = "edgetrain.token";
const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = ["#6aa8ff", "#4cc38a", "#e0a04a", "#c678dd", "#ef6b6b", "#56b6c2"];

const state = {
  token: localStorage.getItem(TOKEN_KEY) || "",
  readAuth: false,
  devices: [],
  jobs: [],
  job: null,
  metrics: [],
  anatomy: null,
  route: { name: "home" },
  source: null,
  pollTimer: null,
};

/* ---------- helpers ---------- */

function $(sel, root) { return (root || document).querySelector(sel); }

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) el.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toFixed(digits === undefined ? 1 : digits);
}

function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(b < 10 && i ? 1 : 0)} ${units[i]}`;
}

function fmtSeconds(sec) {
  if (sec === null || sec === undefined) return "–";
  if (sec < 1) return `${(sec * 1000).toFixed(1)} ms`;
  if (sec < 120) return `${sec.toFixed(1)} s`;
  return `${Math.floor(sec / 60)} min ${Math.round(sec % 60)} s`;
}

function ago(t) {
  if (!t) return "never";
  const d = Date.now() / 1000 - t;
  if (d < 5) return "just now";
  if (d < 90) return `${Math.round(d)} s ago`;
  if (d < 5400) return `${Math.round(d / 60)} min ago`;
  return new Date(t * 1000).toLocaleString();
}

function badge(text) { return h("span", { class: `badge b-${text}` }, text); }

function bar(frac) {
  const pct = Math.max(0, Math.min(1, frac || 0)) * 100;
  return h("div", { class: "bar" }, h("span", { style: `width:${pct.toFixed(1)}%` }));
}

/** Call fn at most once per `ms`, always running the latest call at the end. */
function throttle(fn, ms) {
  let last = 0;
  let timer = null;
  return function run() {
    const wait = last + ms - Date.now();
    if (wait <= 0) {
      last = Date.now();
      fn();
    } else if (!timer) {
      timer = setTimeout(() => { timer = null; last = Date.now(); fn(); }, wait);
    }
  };
}

/* ---------- API and auth ---------- */

class AuthError extends Error {}

async function api(path, options) {
  const opts = Object.assign({ headers: {} }, options || {});
  if (state.token) opts.headers.Authorization = `Bearer ${state.token}`;
  const res = await fetch(API + path, opts);
  if (res.status === 401) {
    if (!opts.method || opts.method === "GET") state.readAuth = true;
    showAuth(state.token ? "That token was refused." : "");
    throw new AuthError("unauthorised");
  }
  if (!res.ok) throw new Error(`${res.status} ${await res.text()}`);
  return res.json();
}

function showAuth(message) {
  const box = $("#auth");
  box.hidden = false;
  $("#auth-msg").textContent = message || "";
}

function setupAuth() {
  $("#auth-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.token = $("#token").value.trim();
    if (state.token) localStorage.setItem(TOKEN_KEY, state.token);
    else localStorage.removeItem(TOKEN_KEY);
    $("#auth").hidden = true;
    startLive();
    refreshAll();
  });
}

/* ---------- data ---------- */

async function loadDevices() {
  state.devices = (await api("/devices")).data;
}

async function loadJobs() {
  state.jobs = (await api("/jobs?limit=50")).data;
}

/** The job and its steps: the whole history on the first load, then only what is new
 * (?since_step=). The last step held is fetched again, as some of its stages may not
 * have reported yet. */
async function loadJob(id) {
  const held = state.metrics;
  const last = held.length ? held[held.length - 1].step : 0;
  const since = last >= 1 ? last - 1 : null;
  const query = since === null ? "" : `?since_step=${since}`;
  const [job, metrics, anatomy] = await Promise.all([
    api(`/jobs/${id}`), api(`/jobs/${id}/metrics${query}`), api(`/jobs/${id}/anatomy`)]);
  if (state.route.name !== "job" || state.route.id !== id) return;
  state.job = job;
  state.anatomy = anatomy;
  state.metrics = since === null ? metrics.steps
    : state.metrics.filter((m) => m.step <= since).concat(metrics.steps);
}

function guard(promise) {
  return promise.catch((err) => {
    if (!(err instanceof AuthError)) console.warn(err);
  });
}

const refreshFleet = throttle(() => guard(loadDevices().then(render)), 1000);
const refreshJobs = throttle(() => guard(loadJobs().then(render)), 1000);
const refreshJob = throttle(() => {
  if (state.route.name === "job") guard(loadJob(state.route.id).then(render));
}, 1000);

function refreshAll() {
  refreshFleet();
  if (state.route.name === "job") refreshJob();
  else refreshJobs();
}

/* ---------- live updates ---------- */

function setLive(mode) {
  const el = $("#live");
  el.className = `live ${mode}`;
  el.textContent = { on: "live", poll: "polling", off: "offline" }[mode] || mode;
}

function startPolling() {
  if (state.pollTimer) return;
  setLive("poll");
  state.pollTimer = setInterval(refreshAll, 3000);
}

function stopPolling() {
  if (state.pollTimer) clearInterval(state.pollTimer);
  state.pollTimer = null;
}

function startLive() {
  if (state.source) { state.source.close(); state.source = null; }
  if (state.readAuth) { startPolling(); return; }
  stopPolling();
  const src = new EventSource(`${API}/events`);
  state.source = src;
  src.onopen = () => { stopPolling(); setLive("on"); };
  src.onerror = () => {
    // The browser reconnects by itself; poll meanwhile so the page stays current.
    startPolling();
  };
  src.addEventListener("device", refreshFleet);
  src.addEventListener("job", (ev) => {
    refreshJobs();
    const data = JSON.parse(ev.data || "{}");
    if (state.route.name === "job" && data.id === state.route.id) refreshJob();
  });
  src.addEventListener("step", (ev) => {
    const data = JSON.parse(ev.data || "{}");
    if (state.route.name === "job" && data.job === state.route.id) refreshJob();
    else refreshJobs();
  });
}

/* ---------- views: overview ---------- */

function fleetTable() {
  const rows = state.devices.map((d) => {
    const p = d.profile || {};
    const job = d.job ? h("a", { href: `#/jobs/${d.job}` }, d.job) : h("span", { class: "muted" }, "–");
    return h("tr", { "data-device": d.id },
      h("td", { class: "mono" }, d.id),
      h("td", {}, badge(d.state)),
      h("td", { class: "num" }, fmt(p.gflops, 1)),
      h("td", { class: "num" }, fmtBytes(p.memory_bytes)),
      h("td", { class: "num" }, p.bandwidth_mbps ? `${fmt(p.bandwidth_mbps, 0)} Mbit/s` : "–"),
      h("td", { class: "num" }, p.latency_ms !== undefined ? `${fmt(p.latency_ms, 1)} ms` : "–"),
      h("td", {}, job, d.stage !== null && d.stage !== undefined ? ` · stage ${d.stage}` : ""),
      h("td", { class: "muted" }, ago(d.last_seen)));
  });
  const online = state.devices.filter((d) => d.state !== "offline").length;
  return h("section", { class: "panel span-6", id: "fleet" },
    h("header", {}, h("h2", {}, "Fleet"),
      h("span", { class: "aside" }, `${online} of ${state.devices.length} online`)),
    h("div", { class: "table-wrap" }, h("table", {},
      h("thead", {}, h("tr", {},
        h("th", {}, "Device"), h("th", {}, "Status"), h("th", { class: "num" }, "GFLOP/s"),
        h("th", { class: "num" }, "Memory"), h("th", { class: "num" }, "Link"),
        h("th", { class: "num" }, "Latency"), h("th", {}, "Job"), h("th", {}, "Last seen"))),
      h("tbody", {}, rows.length ? rows
        : h("tr", {}, h("td", { colspan: 8, class: "empty" }, "No device has announced itself yet."))))));
}

function jobSteps(job) { return (job.spec && job.spec.steps) || 0; }

function jobsTable() {
  const rows = state.jobs.map((j) => {
    const total = jobSteps(j);
    return h("tr", { "data-job": j.id },
      h("td", { class: "mono" }, h("a", { href: `#/jobs/${j.id}` }, j.id)),
      h("td", {}, badge(j.state)),
      h("td", {}, (j.spec && j.spec.model) || "–"),
      h("td", {}, h("div", { class: "progress" }, bar(total ? j.steps_done / total : 0),
        h("span", { class: "num muted" }, `${j.steps_done}/${total}`))),
      h("td", { class: "num" }, fmt(j.samples_per_s, 1)),
      h("td", { class: "muted" }, ago(j.created)));
  });
  return h("section", { class: "panel span-6", id: "jobs" },
    h("header", {}, h("h2", {}, "Jobs"), h("span", { class: "aside" }, `${state.jobs.length} shown`)),
    h("div", { class: "table-wrap" }, h("table", {},
      h("thead", {}, h("tr", {},
        h("th", {}, "Job"), h("th", {}, "State"), h("th", {}, "Model"), h("th", {}, "Progress"),
        h("th", { class: "num" }, "Samples/s"), h("th", {}, "Created"))),
      h("tbody", {}, rows.length ? rows
        : h("tr", {}, h("td", { colspan: 6, class: "empty" }, "No jobs yet. Submit one with edgetrain submit or POST /api/v1/jobs."))))));
}

function renderHome(view) {
  view.replaceChildren(h("div", { class: "grid" }, fleetTable(), jobsTable()));
}

/* ---------- charts ---------- */

function niceTicks(lo, hi, n) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((st) => (hi - lo) / st <= n) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-12; v += step) out.push(v);
  return out;
}

/** A line chart: series = [{name, color, points:[[x, y], ...]}]. */
function lineChart(id, series, opts) {
  const W = 600, H = opts.height || 180, L = 44, R = 8, T = 8, B = 22;
  const all = series.flatMap((se) => se.points);
  if (!all.length) return h("div", { class: "chart-empty", id }, opts.empty || "Waiting for steps…");
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = opts.yMin !== undefined ? opts.yMin : Math.min(...all.map((p) => p[1]));
  let y1 = opts.yMax !== undefined ? opts.yMax : Math.max(...all.map((p) => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += 0.5; y0 -= opts.yMin !== undefined ? 0 : 0.5; }
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = s("svg", { id, viewBox: `0 0 ${W} ${H}`, role: "img" });
  for (const v of niceTicks(y0, y1, 4)) {
    svg.append(s("line", { class: "grid-line", x1: L, x2: W - R, y1: py(v), y2: py(v) }),
      s("text", { x: L - 6, y: py(v) + 3, "text-anchor": "end" }, opts.yFormat ? opts.yFormat(v) : +v.toPrecision(3)));
  }
  for (const v of niceTicks(x0, x1, 6)) {
    svg.append(s("text", { x: px(v), y: H - 6, "text-anchor": "middle" }, Math.round(v)));
  }
  svg.append(s("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  for (const se of series) {
    // At most ~1200 vertices per line; data-points still counts every point.
    const k = Math.ceil(se.points.length / 1200);
    const drawn = k > 1 ? se.points.filter((_, i) => i % k === 0 || i === se.points.length - 1) : se.points;
    const pts = drawn.map((p) => `${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" ");
    svg.append(s("polyline", { class: "series", stroke: se.color, points: pts,
      "stroke-opacity": se.opacity || 1, "data-points": se.points.length }));
  }
  return svg;
}

/** A plan stage's members: ``[{device, share}]`` in member order, shares adding up to 1.
 * A group's stage carries ``devices`` and ``shares``; a one-device stage may carry only
 * ``device``. */
function stageMembers(st) {
  const devices = st.devices && st.devices.length ? st.devices : [st.device];
  const raw = st.shares && st.shares.length === devices.length ? st.shares : devices.map(() => 1);
  const total = raw.reduce((a, b) => a + b, 0) || 1;
  return devices.map((device, m) => ({ device, share: raw[m] / total }));
}

/** A stage's name in a row label: its device, or its group's size. */
function stageLabel(i, st) {
  const members = stageMembers(st);
  return (members.length > 1 ? `${i} group of ${members.length}` : `${i} ${members[0].device}`).slice(0, 14);
}

/** The simulated pipeline: one row per stage, F and B blocks per microbatch; a group's
 * row lists its members under the lane, each with its share of every microbatch. */
function timelineChart(plan) {
  const sim = plan && plan.simulation;
  const stages = (plan && plan.stages) || [];
  if (!sim || !sim.timeline || !stages.length) {
    return h("div", { class: "chart-empty", id: "timeline" }, "No plan yet.");
  }
  const W = 600, rowH = 24, gap = 6, L = 88, R = 8, B = 20, memberH = 14;
  const extra = (st) => { const n = stageMembers(st).length; return n > 1 ? n * memberH : 0; };
  const tops = [];
  let H = B;
  for (const st of stages) { tops.push(H - B); H += rowH + extra(st) + gap; }
  const end = sim.step_time_s || Math.max(...sim.timeline.map((e) => e.end_s));
  const px = (t) => L + (t / end) * (W - L - R);
  const svg = s("svg", { id: "timeline", viewBox: `0 0 ${W} ${H}`, role: "img" });
  stages.forEach((st, i) => {
    const y = tops[i];
    const members = stageMembers(st);
    const g = s("g", { class: "tl-row", "data-stage": i, "data-members": members.length });
    g.append(s("text", { x: 0, y: y + rowH / 2 + 3 }, stageLabel(i, st)),
      s("rect", { class: "lane", x: L, y, width: W - L - R, height: rowH, rx: 2 }));
    if (members.length > 1) {
      members.forEach((mem, m) => {
        const my = y + rowH + m * memberH;
        const pct = `${Math.round(mem.share * 100)}%`;
        const row = s("g", { class: "tl-member", "data-member": m, "data-device": mem.device,
          "data-share": mem.share.toFixed(4) });
        row.append(s("title", {}, `member ${m}: ${mem.device}, ${pct} of each microbatch`),
          s("text", { x: 8, y: my + memberH / 2 + 3 }, mem.device.slice(0, 12)),
          s("rect", { class: "share", x: L, y: my + 3, width: Math.max(1, mem.share * (W - L - R - 40)),
            height: memberH - 6, rx: 1.5 }),
          s("text", { x: L + mem.share * (W - L - R - 40) + 4, y: my + memberH / 2 + 3 }, pct));
        g.append(row);
      });
    }
    for (const e of sim.timeline) {
      if (e.lane !== "stage" || e.index !== i) continue;
      const x = px(e.start_s), w = Math.max(0.6, px(e.end_s) - x);
      const r = s("rect", { class: e.kind, x, y: y + 2, width: w, height: rowH - 4, rx: 1.5 });
      r.append(s("title", {}, `${e.kind}${e.microbatch}: ${fmtSeconds(e.start_s)} – ${fmtSeconds(e.end_s)}`));
      g.append(r);
      if (w > 12) g.append(s("text", { class: "mb", x: x + w / 2, y: y + rowH / 2 + 3, "text-anchor": "middle" }, e.microbatch));
    }
    svg.append(g);
  });
  for (const v of niceTicks(0, end * 1000, 6)) {
    svg.append(s("text", { x: px(v / 1000), y: H - 4, "text-anchor": "middle" }, `${+v.toPrecision(3)} ms`));
  }
  return svg;
}

/** Measured, latest step: per stage, compute then wait, on the same kind of axis. */
function measuredChart(last, nStages) {
  if (!last || !last.stages.length) return h("div", { class: "chart-empty", id: "measured" }, "Waiting for the first step…");
  // A group's members each report: the stage's row shows the one that took longest.
  const byStage = new Map();
  for (const r of last.stages) {
    const held = byStage.get(r.stage);
    if (!held || r.compute_s + r.wait_s > held.compute_s + held.wait_s) byStage.set(r.stage, r);
  }
  const stages = [...byStage.values()].sort((a, b) => a.stage - b.stage);
  const W = 600, rowH = 24, gap = 6, L = 88, R = 8, B = 20;
  const rows = Math.max(nStages || 0, stages.length);
  const H = rows * (rowH + gap) + B;
  const end = Math.max(...stages.map((r) => Math.max(r.step_s, r.compute_s + r.wait_s))) || 1;
  const px = (t) => L + (t / end) * (W - L - R);
  const svg = s("svg", { id: "measured", class: "measured", viewBox: `0 0 ${W} ${H}`, role: "img" });
  for (const r of stages) {
    const y = r.stage * (rowH + gap);
    const g = s("g", { class: "tl-row", "data-stage": r.stage });
    g.append(s("text", { x: 0, y: y + rowH / 2 + 3 }, `${r.stage} ${r.device}`.slice(0, 14)),
      s("rect", { class: "lane", x: L, y, width: W - L - R, height: rowH, rx: 2 }));
    const c = s("rect", { class: "compute", x: L, y: y + 2, width: px(r.compute_s) - L, height: rowH - 4, rx: 1.5 });
    c.append(s("title", {}, `compute ${fmtSeconds(r.compute_s)}`));
    const w = s("rect", { class: "wait", x: px(r.compute_s), y: y + 2, width: px(r.compute_s + r.wait_s) - px(r.compute_s), height: rowH - 4, rx: 1.5 });
    w.append(s("title", {}, `wait ${fmtSeconds(r.wait_s)}`));
    g.append(c, w);
    svg.append(g);
  }
  for (const v of niceTicks(0, end * 1000, 6)) {
    svg.append(s("text", { x: px(v / 1000), y: H - 4, "text-anchor": "middle" }, `${+v.toPrecision(3)} ms`));
  }
  return svg;
}

/** The parts of a step (coordinator/planner/anatomy.py), in the order they stack. */
const PARTS = [
  ["compute", "var(--ok)"], ["fixed", "#8a6fd1"], ["bubble", "#454c55"],
  ["imbalance", "#ef6b6b"], ["link", "var(--fwd)"], ["group_sum", "var(--bwd)"],
];

/** Where the step goes, per stage member: the plan's predicted parts above the measured
 * ones (the mean over the steps measured), stacked, on one axis. */
function anatomyChart(anat) {
  const predicted = anat && anat.predicted, measured = anat && anat.measured;
  const rows = (predicted || measured || { members: [] }).members;
  if (!rows.length) return h("div", { class: "chart-empty", id: "anatomy" }, "No plan yet.");
  const W = 1000, barH = 10, rowH = 2 * barH + 8, L = 150, R = 8, B = 20;
  const H = rows.length * rowH + B;
  const total = (m) => PARTS.reduce((a, [p]) => a + (m[p] || 0), 0);
  const all = [predicted, measured].filter(Boolean).flatMap((a) => a.members.map(total));
  const end = Math.max(...all) || 1;
  const px = (t) => L + (t / end) * (W - L - R);
  const svg = s("svg", { id: "anatomy", viewBox: `0 0 ${W} ${H}`, role: "img" });
  rows.forEach((row, i) => {
    const y = i * rowH;
    const g = s("g", { class: "an-row", "data-stage": row.stage, "data-device": row.device });
    g.append(s("text", { x: 0, y: y + barH + 3 }, `${row.stage} ${row.device}`.slice(0, 16)));
    [["predicted", predicted], ["measured", measured]].forEach(([kind, side], k) => {
      const m = side && side.members[i];
      if (!m) return;
      const bar = s("g", { class: "an-bar", "data-kind": kind, "data-total": total(m).toFixed(6) });
      let at = 0;
      for (const [part, color] of PARTS) {
        const sec = m[part] || 0;
        const r = s("rect", { class: `part-${part}`, "data-seconds": sec.toFixed(6), fill: color,
          x: px(at), y: y + k * (barH + 2), width: Math.max(0, px(at + sec) - px(at)), height: barH });
        r.append(s("title", {}, `${kind} ${part.replace("_", " ")}: ${fmtSeconds(sec)}`));
        bar.append(r);
        at += sec;
      }
      g.append(bar);
    });
    svg.append(g);
  });
  for (const v of niceTicks(0, end * 1000, 6)) {
    svg.append(s("text", { x: px(v / 1000), y: H - 4, "text-anchor": "middle" }, `${+v.toPrecision(3)} ms`));
  }
  return svg;
}

/** The anatomy panel's aside: what was measured, and the largest loss of each side. */
function anatomyAside(anat) {
  const said = [];
  if (anat && anat.predicted) said.push(`predicted: most lost to ${anat.predicted.largest_loss.replace("_", " ")}`);
  if (anat && anat.measured) {
    said.push(`measured over ${anat.measured.steps} steps: most lost to ${anat.measured.largest_loss.replace("_", " ")}`);
  }
  return said.join(" · ");
}

function legend(items) {
  return h("div", { class: "legend" }, items.map(([c, label]) => h("span", {}, h("i", { style: `background:${c}` }), label)));
}

/* ---------- views: job ---------- */

/** A trailing moving average over `n` points. */
function smooth(points, n) {
  let sum = 0;
  return points.map((p, i) => {
    sum += p[1];
    if (i >= n) sum -= points[i - n][1];
    return [p[0], sum / Math.min(n, i + 1)];
  });
}

function utilisation(metrics) {
  // Per device: compute_s / step_s for each step, smoothed over the last 10 steps.
  const byDevice = new Map();
  for (const m of metrics) {
    for (const st of m.stages) {
      if (!(st.step_s > 0)) continue;
      if (!byDevice.has(st.device)) byDevice.set(st.device, []);
      byDevice.get(st.device).push([m.step, Math.min(1, st.compute_s / st.step_s)]);
    }
  }
  return [...byDevice.entries()].map(([device, pts], i) => {
    const smooth = pts.map((p, k) => {
      const win = pts.slice(Math.max(0, k - 9), k + 1);
      return [p[0], win.reduce((a, q) => a + q[1], 0) / win.length];
    });
    const recent = pts.slice(-10);
    const avg = recent.reduce((a, q) => a + q[1], 0) / recent.length;
    return { name: device, color: COLORS[i % COLORS.length], points: smooth, avg };
  });
}

function renderJob(view) {
  const j = state.job;
  if (!j) { view.replaceChildren(h("p", { class: "muted" }, "Loading…")); return; }
  const total = jobSteps(j);
  const plan = j.plan || {};
  const metrics = state.metrics;
  const loss = metrics.filter((m) => m.loss !== null && m.loss !== undefined).map((m) => [m.step, m.loss]);
  const sps = metrics.filter((m) => m.samples_per_s).map((m) => [m.step, m.samples_per_s]);
  const last = metrics.length ? metrics[metrics.length - 1] : null;
  const util = utilisation(metrics);
  const sim = plan.simulation || {};
  const active = !["completed", "failed", "cancelled"].includes(j.state);
  const cancel = active ? h("button", { class: "danger", onclick: () => cancelJob(j.id) }, "Cancel job") : null;
  const tail = (pts) => (pts.length ? smooth(pts.slice(-20), 20).pop()[1] : null);
  const lastLoss = tail(loss);
  const liveSps = j.samples_per_s !== null && j.samples_per_s !== undefined ? j.samples_per_s : tail(sps);

  const head = h("section", { class: "panel", id: "job-head" },
    h("div", { class: "jobhead" },
      h("a", { href: "#/" }, "← Overview"),
      h("h1", { class: "mono" }, j.id), badge(j.state),
      h("span", { class: "muted" }, `${(j.spec && j.spec.model) || ""} on ${(j.spec && j.spec.dataset) || ""}`),
      h("span", { class: "spacer" }), cancel),
    j.reason ? h("div", { class: "reason" }, j.reason) : null,
    h("div", { class: "progress", style: "margin-top:10px" }, bar(total ? j.steps_done / total : 0),
      h("span", { class: "num muted" }, `${j.steps_done} / ${total} steps`)),
    h("div", { class: "stats" },
      stat("Loss (20-step mean)", fmt(lastLoss, 4)),
      stat("Samples/s", fmt(liveSps, 1)),
      stat("Predicted", fmt(plan.throughput_sps, 1)),
      stat("Measured / predicted", liveSps && plan.throughput_sps ? fmt(liveSps / plan.throughput_sps, 2) : "–"),
      stat("Stages", (plan.stages || []).length || "–"),
      stat("Microbatches", plan.microbatches !== undefined
        ? `${plan.microbatches}${j.spec && j.spec.microbatches === "auto" ? " (auto)" : ""}`
        : (j.spec ? j.spec.microbatches : "–")),
      stat("Schedule", plan.schedule !== undefined
        ? `${plan.schedule}${j.spec && j.spec.schedule === "auto" ? " (auto)" : ""}`
        : (j.spec ? j.spec.schedule : "–")),
      stat("Training", plan.training || "exact"),
      stat("Bubble (sim)", sim.bubble_fraction !== undefined ? `${fmt(sim.bubble_fraction * 100, 0)} %` : "–"),
      stat("Planner", plan.method || "–")));

  const stagesTable = h("table", {},
    h("thead", {}, h("tr", {}, h("th", {}, "Stage"), h("th", {}, "Device"), h("th", {}, "Layers"),
      h("th", { class: "num" }, "Compute/mb"), h("th", { class: "num" }, "Link/mb"))),
    h("tbody", {}, (plan.stages || []).map((st, i) => {
      const units = plan.units || [];
      const names = units.length ? `${units[st.layers[0]] || st.layers[0]} … ${units[st.layers[1] - 1] || st.layers[1]}` : "";
      const members = stageMembers(st);
      const who = members.length > 1
        ? members.map((mem) => `${mem.device} ${Math.round(mem.share * 100)}%`).join(" · ")
        : members[0].device;
      return h("tr", {}, h("td", { class: "num" }, i), h("td", { class: "mono" }, who),
        h("td", { class: "mono", title: names }, `${st.layers[0]}–${st.layers[1]}`),
        h("td", { class: "num" }, fmtSeconds((plan.compute_s || [])[i])),
        h("td", { class: "num" }, i < (plan.link_s || []).length ? fmtSeconds(plan.link_s[i]) : "–"));
    })));

  view.replaceChildren(h("div", { class: "grid" },
    head,
    h("section", { class: "panel span-6" },
      h("header", {}, h("h2", {}, "Planned pipeline (simulated step)"),
        h("span", { class: "aside" }, fmtSeconds(sim.step_time_s))),
      timelineChart(plan),
      legend([["var(--fwd)", "forward"], ["var(--bwd)", "backward"]])),
    h("section", { class: "panel span-6" },
      h("header", {}, h("h2", {}, "Measured, latest step"),
        h("span", { class: "aside" }, last ? `step ${last.step} · ${fmtSeconds(Math.max(...last.stages.map((r) => r.step_s)))}` : "")),
      measuredChart(last, (plan.stages || []).length),
      legend([["var(--ok)", "compute"], ["#454c55", "wait"]])),
    h("section", { class: "panel span-12", id: "anatomy-panel" },
      h("header", {}, h("h2", {}, "Where the step goes (per member: predicted, then measured)"),
        h("span", { class: "aside" }, anatomyAside(state.anatomy))),
      anatomyChart(state.anatomy),
      legend(PARTS.map(([p, c]) => [c, p.replace("_", " ")]))),
    h("section", { class: "panel span-6" },
      h("header", {}, h("h2", {}, "Loss"), h("span", { class: "aside" }, `${loss.length} steps`)),
      lineChart("loss-chart", [{ name: "loss", color: "#6aa8ff", points: loss, opacity: 0.35 },
        { name: "smoothed", color: "#6aa8ff", points: smooth(loss, 20) }], { height: 200 }),
      legend([["rgba(106,168,255,.35)", "per step"], ["#6aa8ff", "mean of 20 steps"]])),
    h("section", { class: "panel span-6" },
      h("header", {}, h("h2", {}, "Samples/s"), h("span", { class: "aside" }, plan.throughput_sps ? `predicted ${fmt(plan.throughput_sps, 1)}` : "")),
      lineChart("sps-chart", [{ name: "samples/s", color: "#4cc38a", points: sps, opacity: 0.35 },
        { name: "smoothed", color: "#4cc38a", points: smooth(sps, 20) }], { height: 200, yMin: 0 }),
      legend([["rgba(76,195,138,.35)", "per step"], ["#4cc38a", "mean of 20 steps"]])),
    h("section", { class: "panel span-6" },
      h("header", {}, h("h2", {}, "Utilisation per device"), h("span", { class: "aside" }, "compute / step time, last 10 steps")),
      lineChart("util-chart", util, { height: 160, yMin: 0, yMax: 1, yFormat: (v) => `${Math.round(v * 100)}%` }),
      legend(util.map((u) => [u.color, `${u.name} ${fmt(u.avg * 100, 0)}%`]))),
    h("section", { class: "panel span-6" },
      h("header", {}, h("h2", {}, "Plan")),
      h("div", { class: "table-wrap" }, stagesTable)),
    h("section", { class: "panel span-6", id: "egress" },
      h("header", {}, h("h2", {}, "What leaves each device"), h("span", { class: "aside" }, "per step")),
      h("div", { class: "table-wrap" }, egressTable(plan.egress || [])))));
}

function egressTable(rows) {
  return h("table", {},
    h("thead", {}, h("tr", {}, h("th", {}, "From"), h("th", {}, "To"), h("th", {}, "What"),
      h("th", {}, "Shape / sample"), h("th", {}, "Codec"))),
    h("tbody", {}, rows.map((r) => h("tr", {},
      h("td", { class: "mono" }, r.from.join(", ")),
      h("td", { class: "mono" }, r.to.join(", ")),
      h("td", {}, r.what),
      h("td", { class: "mono" }, r.shape ? `[${r.shape.join(", ")}]` : "–"),
      h("td", { class: "mono" }, r.codec)))));
}

function stat(k, v) {
  return h("div", { class: "stat" }, h("div", { class: "k" }, k), h("div", { class: "v" }, v));
}

async function cancelJob(id) {
  if (!confirm(`Cancel job ${id}?`)) return;
  try {
    await api(`/jobs/${id}/cancel`, { method: "POST" });
  } catch (err) {
    if (!(err instanceof AuthError)) alert(`Could not cancel: ${err.message}`);
  }
  refreshJob();
}

/* ---------- routing ---------- */

function parseRoute() {
  const m = location.hash.match(/^#\/jobs\/([^/?#]+)/);
  return m ? { name: "job", id: decodeURIComponent(m[1]) } : { name: "home" };
}

function render() {
  const view = $("#view");
  if (state.route.name === "job") renderJob(view);
  else renderHome(view);
}

function onRoute() {
  state.route = parseRoute();
  state.job = null;
  state.metrics = [];
  state.anatomy = null;
  render();
  if (state.route.name === "job") guard(loadJob(state.route.id).then(render));
  else guard(Promise.all([loadDevices(), loadJobs()]).then(render));
}

async function main() {
  setupAuth();
  window.addEventListener("hashchange", onRoute);
  // Probe once so that read-auth mode is known before choosing SSE or polling.
  await guard(Promise.all([loadDevices(), loadJobs()]));
  startLive();
  onRoute();
}

main();
