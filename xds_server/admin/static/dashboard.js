// xds-sentinel dashboard: renders the admin's live feed (GET /live, Server-Sent Events).
// No build step, no external resources. Text from the server is set with textContent only.
// The admin token lives in the password field only: it is sent as a bearer header on drain /
// undrain and never stored (not in localStorage, not in a cookie, not in the URL).
"use strict";

const MAX_EVENTS = 200;       // event feed entries kept in the page
// The recent past comes from the control plane (GET /history, fetched each time /live accepts
// the page, before its first message is read): the page opens, and resumes after a pause, with
// its sparklines and timelines full. Live snapshots extend it at
// the same resolution; points older than the window are dropped.
const past = {interval: 2, window: 900, states: [], nodes: new Map()};  // id -> {t, state, weight, rtt, ttft}
const STATE_COLOR = {HEALTHY: "#1f9d55", PROBATION: "#2b7bd6", DEGRADED: "#d69e2e", UNHEALTHY: "#d64545",
  DRAINING: "#8a5cd6", WARMING: "#7a8699", COLD: "#a0a8b5", FAIL_STATIC: "#b7410e", UNREACHABLE: "#4b5563",
  HELD_BACK: "#c2851b"};

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}

function fmtMs(v) { return v == null ? "–" : (v < 10 ? v.toFixed(2) : v.toFixed(0)) + " ms"; }
function fmtAgo(s) { return s >= 120 ? `${(s / 60).toFixed(0)} min` : `${s.toFixed(0)} s`; }
function fmtS(v) { return v == null ? "–" : (v < 10 ? v.toFixed(1) : v.toFixed(0)) + " s"; }

const NS = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

// The time span drawn: the window, or less while the history is younger than it.
function span(now) {
  let first = now;
  for (const h of past.nodes.values()) if (h.t.length && h.t[0] < first) first = h.t[0];
  const t0 = Math.max(first, now - past.window);
  return {t0, t1: now, width: Math.max(now - t0, past.interval)};
}

function spark(times, values, sp) {
  const svg = svgEl("svg", {class: "spark", viewBox: "0 0 110 26", preserveAspectRatio: "none"});
  const pts = [];
  for (let i = 0; i < times.length; i++) if (values[i] != null && times[i] >= sp.t0) pts.push([times[i], values[i]]);
  if (pts.length > 1) {
    const vs = pts.map(p => p[1]);
    const max = Math.max(...vs), min = Math.min(...vs), range = (max - min) || 1;
    svg.append(svgEl("polyline", {points: pts.map(([t, v]) =>
      `${(110 * (t - sp.t0) / sp.width).toFixed(1)},${(24 - ((v - min) / range) * 22).toFixed(1)}`).join(" ")}));
    const title = svgEl("title");
    title.textContent = `last ${fmtS(sp.width)}: min ${min.toFixed(1)} ms, max ${max.toFixed(1)} ms`;
    svg.append(title);
  }
  return svg;
}

function seriesOf(id) {
  let h = past.nodes.get(id);
  if (!h) { h = {t: [], state: [], weight: [], full: 0, rtt: [], ttft: []}; past.nodes.set(id, h); }
  return h;
}

function trim(h, now) {
  let k = 0;
  while (k < h.t.length && h.t[k] < now - past.window) k++;
  if (k) for (const a of [h.t, h.state, h.weight, h.rtt, h.ttft]) a.splice(0, k);
}

// A live snapshot extends the history once per history interval.
function remember(n, now) {
  const h = seriesOf(n.id);
  h.full = n.full_weight;
  if (h.t.length && now - h.t[h.t.length - 1] < past.interval * 0.9) return h;
  h.t.push(now); h.state.push(n.display_state || n.state); h.weight.push(routed(n) ? n.weight : null);
  h.rtt.push(n.ewma_rtt_ms); h.ttft.push(n.last_ttft_ms);
  trim(h, now);
  return h;
}

function loadHistory(doc) {
  past.interval = doc.interval_s; past.window = doc.window_s; past.states = doc.states;
  const neg = v => (v < 0 ? null : v);
  for (const [id, s] of Object.entries(doc.nodes)) {
    const h = seriesOf(id);
    h.full = s.full_weight;
    s.state.forEach((st, i) => {
      if (st < 0) return;  // no sample of this node then (added later)
      h.t.push(doc.t[i]); h.state.push(doc.states[st]); h.weight.push(neg(s.weight[i]));
      h.rtt.push(neg(s.rtt_ms[i])); h.ttft.push(neg(s.ttft_ms[i]));
    });
  }
}

function routed(n) { return n.routed != null ? n.routed : n.eds_health_status === "HEALTHY"; }

// One cluster's last minutes: a band per node coloured by its shown state, its published weight
// (share of full weight) drawn over it; a gap in the line: not routed ("-").
function timeline(nodes, sp) {
  const rowH = 16, labelW = 0, W = 1000, H = Math.max(1, nodes.length) * rowH;
  const svg = svgEl("svg", {class: "timeline", viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
    height: String(H), "data-nodes": String(nodes.length)});
  const x = t => labelW + (W - labelW) * (t - sp.t0) / sp.width;
  nodes.forEach((n, row) => {
    const h = past.nodes.get(n.id);
    const y = row * rowH;
    const g = svgEl("g", {"data-node": n.id});
    if (h && h.t.length) {
      let start = 0;
      for (let i = 1; i <= h.t.length; i++) {
        if (i < h.t.length && h.state[i] === h.state[start]) continue;
        const x0 = x(Math.max(h.t[start], sp.t0)), x1 = i < h.t.length ? x(h.t[i]) : W;
        if (x1 > x0) {
          const r = svgEl("rect", {x: x0.toFixed(1), y: y + 1, width: (x1 - x0).toFixed(1), height: rowH - 2,
            fill: STATE_COLOR[h.state[start]] || "#999", "data-state": h.state[start]});
          const tip = svgEl("title");
          tip.textContent = `${n.id}: ${h.state[start]} from ${new Date(h.t[start] * 1000).toLocaleTimeString()}`;
          r.append(tip);
          g.append(r);
        }
        start = i;
      }
      const segs = [];
      let cur = [];
      h.t.forEach((t, i) => {
        const w = h.weight[i];
        if (w == null || t < sp.t0) { if (cur.length > 1) segs.push(cur); cur = []; return; }
        cur.push(`${x(t).toFixed(1)},${(y + rowH - 2 - (rowH - 4) * Math.min(1, w / (h.full || 1))).toFixed(1)}`);
      });
      if (cur.length > 1) segs.push(cur);
      for (const s of segs) g.append(svgEl("polyline", {class: "weight", points: s.join(" ")}));
    }
    svg.append(g);
  });
  const names = el("div", {class: "tl-names"}, ...nodes.map(n => el("div", {text: n.id})));
  const axis = el("div", {class: "tl-axis muted"}, el("span", {text: `${fmtAgo(sp.width)} ago`}),
    el("span", {text: "state band, white line: published weight (share of full)"}), el("span", {text: "now"}));
  return el("div", {class: "tl"}, names, el("div", {}, svg, axis));
}

function clusterBanner(c, fs) {
  if (c.fail_static_held || (fs && c.nodes > 0 && (fs.held_clusters || []).includes(c.name))) {
    return el("div", {class: "cbanner failstatic", "data-banner": "fail-static",
      text: `FAIL-STATIC holds ${c.name}: Envoy keeps its last good assignment; health verdicts are not applied`});
  }
  const cf = c.traffic && c.traffic.cluster_failure;
  if (cf) {
    return el("div", {class: "cbanner nothing", "data-banner": "cluster-failure",
      text: `CLUSTER FAILURE in ${c.name}: ${cf.scopes.map(s => s.reason).join("; ")}`});
  }
  if (c.nodes > 0 && c.routable === 0) {
    return el("div", {class: "cbanner nothing", "data-banner": "nothing-routable",
      text: `NOTHING ROUTABLE in ${c.name}: 0 of ${c.nodes} node(s) routed; Envoy has nowhere to send its requests`});
  }
  return null;
}

// A gated shift: phase, commanded share, next decision, the last window's gates.
function shiftLine(c) {
  const v = c.shift;
  if (!v || v.phase === "cancelled") return null;
  const g = v.last_gate, w = v.window_so_far;
  const parts = [`SHIFT to ${v.to.kind} ${v.to.value}: ${v.phase} at ${v.share_percent} %`];
  if (!v.hard) parts.push(`+${v.step_percent} % every ${fmtS(v.every_s)}`);
  if (v.next_decision_in_s != null) parts.push(`next decision in ${fmtS(v.next_decision_in_s)}`);
  if (w) parts.push(`this window: ${w.completed} requests, ${w.errored} errors`);
  if (g) parts.push(`last window: ${g.verdict} (errors ${g.errored}/${g.completed}` +
    (g.latency_increase != null ? `, latency ${g.latency_increase >= 0 ? "+" : ""}${(g.latency_increase * 100).toFixed(1)} %` : "") + ")");
  if (v.reason) parts.push(v.reason);
  return el("div", {class: `cbanner shift ${v.phase}`, "data-banner": "shift", text: parts.join(" · ")});
}

// "why not routed and until when": the reason and the next moment something can change.
function whyCell(n) {
  const td = el("td", {class: "why"});
  const p = n.probation, d = n.drain;
  if (n.not_routed_because) td.append(el("div", {text: n.not_routed_because}));
  else if (n.state !== "HEALTHY" && n.reason) td.append(el("div", {text: n.reason}));
  if (d) {
    td.append(el("div", {class: "muted", text: `draining ${fmtS(d.draining_for_s)}` +
      (d.in_flight != null ? `, ${d.in_flight} in flight` : "") + (d.drained ? ", drained" : `, timeout ${fmtS(d.timeout_s)}`)}));
  }
  if (p && p.required_clean_s != null) {
    const until = p.next_recheck_in_s == null ? "after probes succeed again" : `recheck in ${fmtS(p.next_recheck_in_s)}`;
    td.append(el("div", {class: "muted", text: `clean ${fmtS(p.clean_for_s)} of ${fmtS(p.required_clean_s)}; ${until}`}));
  }
  return td;
}

function probationCell(n) {
  const td = el("td");
  const p = n.probation;
  if (!p) return td;
  const pct = p.ramp_percent != null ? p.ramp_percent
    : (p.required_clean_s ? Math.min(100, 100 * p.clean_for_s / p.required_clean_s) : 0);
  const bar = el("div", {class: "progress", title: p.ramp_percent != null ? "ramp" : "clean period"},
    el("div", {}));
  bar.firstChild.style.width = `${pct.toFixed(0)}%`;
  td.append(bar, el("div", {class: "muted", text: p.ramp_percent != null
    ? `ramp ${p.ramp_percent.toFixed(0)} %, next +${p.step_percent} % in ${fmtS(p.next_step_in_s)}`
    : `clean ${pct.toFixed(0)} %`}));
  return td;
}

function drainButton(n) {
  const draining = n.state === "DRAINING";
  const b = el("button", {text: draining ? "undrain" : "drain", "data-action": draining ? "undrain" : "drain"});
  b.addEventListener("click", () => operate(n.id, draining ? "undrain" : "drain"));
  return b;
}

// real traffic summed over every Envoy (LRS) beside the probe's view; null without any
function trafficLine(n) {
  const t = n.traffic;
  if (!t || !t.issued) return null;
  const ok = t.success_ratio === null ? "-" : `${(t.success_ratio * 100).toFixed(1)} % ok`;
  return el("div", {class: "muted traffic", text: `real ${t.rps.toFixed(1)} rps, ${ok} (${t.reporting_envoys} Envoys)`});
}

function nodeRow(n, now, sp) {
  const h = remember(n, now);
  const shown = n.display_state || n.state;
  // weight as `xds-server status` shows it: "-" when Envoy does not route to the node
  const weight = routed(n) ? `${n.weight} / ${n.full_weight}` : "-";
  return el("tr", {class: shown, "data-node": n.id, "data-state": shown},
    el("td", {}, el("div", {text: n.id}), el("div", {class: "muted", text: n.address})),
    el("td", {}, el("span", {class: `state ${shown}`, text: shown}),
      shown !== n.health_state ? el("div", {class: "muted", text: `health: ${n.health_state}`}) : null),
    el("td", {class: "num weight", text: weight}),
    el("td", {}, el("span", {class: `eds ${n.eds_health_status}`, text: n.eds_health_status}),
      el("div", {class: "muted", text: n.probe_stream_connected ? "agent connected" : "agent not connected"})),
    el("td", {}, spark(h.t, h.rtt, sp), el("div", {class: "muted", text: `RTT ${fmtMs(n.ewma_rtt_ms)}`})),
    el("td", {}, spark(h.t, h.ttft, sp), el("div", {class: "muted", text: `TTFT ${fmtMs(n.last_ttft_ms)}`}),
      trafficLine(n)),
    whyCell(n),
    probationCell(n),
    el("td", {}, drainButton(n)));
}

function render(s) {
  document.getElementById("failstatic").hidden = !s.fail_static;
  document.getElementById("updated").textContent = "updated " + new Date(s.time * 1000).toLocaleTimeString();
  const byCluster = new Map();
  for (const n of s.nodes) {
    if (!byCluster.has(n.cluster)) byCluster.set(n.cluster, []);
    byCluster.get(n.cluster).push(n);
  }
  for (const id of [...past.nodes.keys()]) if (!s.nodes.some(n => n.id === id)) past.nodes.delete(id);
  for (const n of s.nodes) remember(n, s.time);
  const sp = span(s.time);
  const root = document.getElementById("clusters");
  const sections = s.clusters.map(c => {
    const nodes = byCluster.get(c.name) || [];
    return el("section", {class: "cluster", "data-cluster": c.name},
      el("h2", {}, c.name, el("span", {class: "muted",
        text: `${c.routable}/${c.nodes} routable · EDS ${c.published ? "version " + c.xds_version.slice(0, 12) : "not published yet"}`})),
      clusterBanner(c, s.fail_static_view),
      shiftLine(c),
      timeline(nodes, sp),
      el("table", {},
        el("thead", {}, el("tr", {}, ...["node", "state", "weight", "EDS", "RTT", "TTFT", "why not routed / until",
          "probation", ""].map(t => el("th", {text: t})))),
        el("tbody", {}, ...nodes.map(n => nodeRow(n, s.time, sp)))));
  });
  root.replaceChildren(...sections);
}

function addEvent(e) {
  const list = document.getElementById("events");
  const what = e.kind === "transition"
    ? el("span", {}, `${e.node} ${e.from} → `, el("span", {class: "to", text: e.to}))
    : el("span", {class: "to", text: `${e.kind} ${e.node === "*" ? "" : e.node}`});
  list.prepend(el("li", {"data-kind": e.kind, "data-to": e.to || ""},
    el("span", {class: "t", text: new Date(e.time * 1000).toLocaleTimeString()}), what,
    el("div", {class: "muted", text: e.reason})));
  while (list.children.length > MAX_EVENTS) list.lastChild.remove();
}

function say(text) {
  const m = document.getElementById("message");
  m.textContent = text;
  m.hidden = !text;
}

async function operate(node, action) {
  const token = document.getElementById("token").value;
  if (!token) { say(`${action} needs the admin token: type it in the field at the top right`); return; }
  try {
    const r = await fetch(`/nodes/${encodeURIComponent(node)}/${action}?reason=dashboard`,
      {method: "POST", headers: {"Authorization": `Bearer ${token}`}});
    const body = await r.json().catch(() => ({}));
    say(r.ok ? `${action} ${node}: now ${body.state}` : `${action} ${node} refused (${r.status}): ${body.error || ""}`);
  } catch (err) {
    say(`${action} ${node} failed: ${err}`);
  }
}

// The live feed, read with fetch rather than EventSource: EventSource gives up for good on an
// answer other than 200 (the 503 past admin.live_max_clients) and never says why. Here every
// end (refused, connection lost, control plane unreachable) shows why in #live-notice and
// retries after RETRY_MIN_S doubling to RETRY_MAX_S, each wait jittered by +-25 % so refused
// dashboards do not come back together, and never sooner than the answer's Retry-After (s).
const RETRY_MIN_S = 1, RETRY_MAX_S = 30;

// One SSE message ("event:" and "data:" lines; ":" lines are pings) to its handler.
function dispatch(block) {
  let kind = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) kind = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  if (!data.length) return;
  if (kind === "state") render(JSON.parse(data.join("\n")));
  else if (kind === "event") addEvent(JSON.parse(data.join("\n")));
}

// The past (sparklines and timelines full at once): GET /history replaces what the page holds.
async function loadPast() {
  try {
    const r = await fetch("/history", {cache: "no-store"});
    if (r.ok) { past.nodes.clear(); loadHistory(await r.json()); }
  } catch (err) { /* the live feed alone then */ }
}

// One connection to /live until it ends: why it ended ({status, error, retryAfter} or {lost}).
async function stream() {
  let r;
  try {
    r = await fetch("/live", {cache: "no-store", headers: {"Accept": "text/event-stream"}});
  } catch (err) {
    return {unreachable: String(err)};
  }
  if (!r.ok) {
    const body = await r.json().catch(() => ({}));
    return {status: r.status, error: body.error || "", retryAfter: Number(r.headers.get("Retry-After")) || 0};
  }
  await loadPast();  // after /live accepted us (a refused page does not fetch it on every try)
  const conn = document.getElementById("conn");
  conn.textContent = "live"; conn.className = "conn up";
  notice(null);
  document.getElementById("events").replaceChildren();  // the server resends its event backlog
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return {opened: true, lost: "the control plane closed the live feed"};
      buf += value.replace(/\r\n?/g, "\n");
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) { dispatch(buf.slice(0, i)); buf = buf.slice(i + 2); }
    }
  } catch (err) {
    return {opened: true, lost: "the connection to the control plane was lost"};
  }
}

function notice(why, s) {
  const n = document.getElementById("live-notice");
  n.hidden = !why;
  n.dataset.reason = why ? why.kind : "";
  n.textContent = why ? `live updates paused: ${why.text} - retrying in ${s} s` : "";
}

function pauseReason(end) {
  if (end.status === 503) {
    return {kind: "refused", text: "the control plane refused (503, too many dashboards?)"};
  }
  if (end.status) {
    return {kind: "refused", text: `the control plane refused (${end.status}${end.error ? ": " + end.error : ""})`};
  }
  if (end.unreachable) return {kind: "unreachable", text: "the control plane cannot be reached"};
  return {kind: "lost", text: end.lost};
}

const sleep = ms => new Promise(done => setTimeout(done, ms));

async function connect() {
  const conn = document.getElementById("conn");
  let backoff = RETRY_MIN_S;
  for (;;) {
    const end = await stream();
    if (end.opened) backoff = RETRY_MIN_S;  // it was up: the next try starts from the shortest wait
    const jittered = backoff * (0.75 + 0.5 * Math.random());
    let wait = Math.min(RETRY_MAX_S, Math.max(jittered, end.retryAfter || 0));
    backoff = Math.min(RETRY_MAX_S, backoff * 2);
    const why = pauseReason(end);
    conn.textContent = why.kind === "refused" ? "paused" : "reconnecting"; conn.className = "conn down";
    for (; wait > 0; wait -= 1) {
      notice(why, Math.ceil(wait));
      await sleep(1000 * Math.min(1, wait));
    }
    notice(why, 0);
  }
}

connect();
