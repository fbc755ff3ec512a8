// xds-sentinel dashboard: renders the admin's live feed (GET /live, Server-Sent Events).
// No build step, no external resources. Text from the server is set with textContent only.
// The admin token lives in the password field only: it is sent as a bearer header on drain /
// undrain and never stored (not in localStorage, not in a cookie, not in the URL).
"use strict";

const HISTORY = 60;           // sparkline points kept per node (one per snapshot)
const MAX_EVENTS = 200;       // event feed entries kept in the page
const history = new Map();    // node id -> {rtt: [ms], ttft: [ms]}

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
function fmtS(v) { return v == null ? "–" : (v < 10 ? v.toFixed(1) : v.toFixed(0)) + " s"; }

function spark(values) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 110 26");
  const pts = values.filter(v => v != null);
  if (pts.length > 1) {
    const max = Math.max(...pts), min = Math.min(...pts), span = (max - min) || 1;
    const step = 110 / (HISTORY - 1), off = HISTORY - values.length;
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", values.map((v, i) => v == null ? null :
      `${((off + i) * step).toFixed(1)},${(24 - ((v - min) / span) * 22).toFixed(1)}`).filter(Boolean).join(" "));
    svg.append(line);
    const title = document.createElementNS(ns, "title");
    title.textContent = `min ${min.toFixed(1)} ms, max ${max.toFixed(1)} ms`;
    svg.append(title);
  }
  return svg;
}

function remember(n) {
  let h = history.get(n.id);
  if (!h) { h = {rtt: [], ttft: []}; history.set(n.id, h); }
  h.rtt.push(n.ewma_rtt_ms); h.ttft.push(n.last_ttft_ms);
  if (h.rtt.length > HISTORY) { h.rtt.shift(); h.ttft.shift(); }
  return h;
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

function nodeRow(n) {
  const h = remember(n);
  return el("tr", {class: n.state, "data-node": n.id, "data-state": n.state},
    el("td", {}, el("div", {text: n.id}), el("div", {class: "muted", text: n.address})),
    el("td", {}, el("span", {class: `state ${n.state}`, text: n.state}),
      n.state !== n.health_state ? el("div", {class: "muted", text: `health: ${n.health_state}`}) : null),
    el("td", {class: "num", text: `${n.weight} / ${n.full_weight}`}),
    el("td", {}, el("span", {class: `eds ${n.eds_health_status}`, text: n.eds_health_status}),
      el("div", {class: "muted", text: n.probe_stream_connected ? "agent connected" : "agent not connected"})),
    el("td", {}, spark(h.rtt), el("div", {class: "muted", text: `RTT ${fmtMs(n.ewma_rtt_ms)}`})),
    el("td", {}, spark(h.ttft), el("div", {class: "muted", text: `TTFT ${fmtMs(n.last_ttft_ms)}`})),
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
  const root = document.getElementById("clusters");
  const sections = s.clusters.map(c => el("section", {class: "cluster", "data-cluster": c.name},
    el("h2", {}, c.name, el("span", {class: "muted",
      text: `${c.routable}/${c.nodes} routable · EDS ${c.published ? "version " + c.xds_version.slice(0, 12) : "not published yet"}`})),
    el("table", {},
      el("thead", {}, el("tr", {}, ...["node", "state", "weight", "EDS", "RTT", "TTFT", "why not routed / until",
        "probation", ""].map(t => el("th", {text: t})))),
      el("tbody", {}, ...(byCluster.get(c.name) || []).map(nodeRow)))));
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

function connect() {
  const conn = document.getElementById("conn");
  const es = new EventSource("/live");
  es.addEventListener("open", () => {  // the server resends its event backlog on every (re)connect
    conn.textContent = "live"; conn.className = "conn up";
    document.getElementById("events").replaceChildren();
  });
  es.addEventListener("error", () => { conn.textContent = "reconnecting"; conn.className = "conn down"; });
  es.addEventListener("state", ev => render(JSON.parse(ev.data)));
  es.addEventListener("event", ev => addEvent(JSON.parse(ev.data)));
}

connect();
