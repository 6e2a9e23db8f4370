// Tandem's dashboard: the jobs list and a job's page, plain DOM and SVG. The API key lives in this tab's
// sessionStorage and goes out as `Authorization: Bearer` on fetch; a job's event stream (EventSource, which
// cannot set headers) carries a short-lived stream token for that one job instead.
"use strict";

const KEY = "tandem.apiKey";
const $ = (id) => document.getElementById(id);
let org = "";

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function signOut(message) {
  sessionStorage.removeItem(KEY);
  $("content").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
}

async function api(path, options) {
  const key = sessionStorage.getItem(KEY);
  const headers = Object.assign({ Authorization: "Bearer " + key }, (options && options.headers) || {});
  const response = await fetch(path, Object.assign({}, options, { headers, cache: "no-store" }));
  if (response.status === 401) {
    signOut("The API key was refused.");
    throw new Error("unauthenticated");
  }
  const body = await response.json();
  if (!response.ok) {
    const error = new Error((body.error && body.error.message) || response.statusText);
    error.status = response.status;
    throw error;
  }
  return body;
}

function when(stamp) {
  if (!stamp) return "";
  const date = new Date(stamp);
  return isNaN(date) ? stamp : date.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

// ---- jobs list --------------------------------------------------------------------------------------

async function loadJobs() {
  const body = await api("/api/v1/jobs");
  const rows = $("jobs").tBodies[0];
  rows.replaceChildren();
  for (const job of body.jobs) {
    const tr = el("tr");
    const link = el("a", job.id);
    link.href = "/jobs/" + encodeURIComponent(job.id);
    const name = el("td");
    name.append(link);
    tr.append(name, el("td", job.state), el("td", when(job.create_time)),
      el("td", job.progress.tasks_done + "/" + job.progress.tasks + " tasks done"));
    rows.append(tr);
  }
  $("jobs-empty").hidden = body.jobs.length > 0;
}

// ---- curves -----------------------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
const series = {};  // metric name -> [[step, value], ...]
let drawPending = false;

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function draw() {
  drawPending = false;
  for (const svg of document.querySelectorAll("svg[data-metric]")) {
    const points = series[svg.dataset.metric] || [];
    svg.replaceChildren();
    svg.dataset.points = String(points.length);
    const [w, h, left, bottom] = [320, 160, 40, 18];
    svg.append(svgEl("line", { x1: left, y1: 4, x2: left, y2: h - bottom, class: "axis" }));
    svg.append(svgEl("line", { x1: left, y1: h - bottom, x2: w - 4, y2: h - bottom, class: "axis" }));
    if (!points.length) {
      svg.append(svgEl("text", { x: left + 8, y: h / 2 }, "waiting for train.step events"));
      continue;
    }
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
    let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const sx = (x) => left + ((x - x0) / Math.max(1, x1 - x0)) * (w - left - 8);
    const sy = (y) => 4 + (1 - (y - y0) / (y1 - y0)) * (h - bottom - 8);
    svg.append(svgEl("polyline", {
      class: "line", points: points.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "),
    }));
    svg.append(svgEl("text", { x: 2, y: 12 }, y1.toPrecision(3)));
    svg.append(svgEl("text", { x: 2, y: h - bottom }, y0.toPrecision(3)));
    svg.append(svgEl("text", { x: left, y: h - 4 }, "step " + x0));
    svg.append(svgEl("text", { x: w - 60, y: h - 4 }, "step " + x1));
  }
}

function addStep(step) {
  const at = Number(step.step);
  for (const [name, value] of Object.entries(step.metrics || {})) {
    (series[name] = series[name] || []).push([at, Number(value)]);
  }
  if (!drawPending) { drawPending = true; requestAnimationFrame(draw); }
}

// ---- a job's page -----------------------------------------------------------------------------------

let lastSeq = 0;
let refreshTimer = null;

function jobName() {
  const id = decodeURIComponent(location.pathname.replace(/^\/jobs\//, "").replace(/\/$/, ""));
  return "orgs/" + org + "/jobs/" + id;
}

async function loadJob() {
  try {
    const body = await api("/api/v1/" + jobName());
    $("job-state").textContent = body.job.state;
  } catch (error) {
    if (error.status !== 404) throw error;
    $("job-state").textContent = "no scheduler job (events only)";
  }
}

async function loadCheckpoints() {
  const body = await api("/api/v1/" + jobName() + "/checkpoints");
  const rows = $("checkpoints").tBodies[0];
  rows.replaceChildren();
  for (const c of body.checkpoints) {
    const reward = c.metrics && c.metrics["reward/mean"] !== undefined ? Number(c.metrics["reward/mean"]).toFixed(3) : "";
    const tr = el("tr");
    tr.append(el("td", c.name.split("/").pop()), el("td", c.step || 0), el("td", when(c.create_time)),
      el("td", reward), el("td", c.uri || ""));
    rows.append(tr);
  }
}

function scheduleCheckpoints() {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(() => loadCheckpoints().catch(() => {}), 200);
}

function onEvent(message) {
  const seq = Number(message.lastEventId);
  if (seq <= lastSeq) return;  // never show one twice
  lastSeq = seq;
  const event = JSON.parse(message.data);
  const line = el("li", when(event.time) + "  " + event.type + "  " + (event.message || ""),
    (event.level || "").replace("LEVEL_", "").toLowerCase());
  line.value = seq;
  const log = $("events");
  log.append(line);
  while (log.children.length > 500) log.firstChild.remove();
  log.scrollTop = log.scrollHeight;
  if (event.train_step) addStep(event.train_step);
  if (event.checkpoint_saved) scheduleCheckpoints();
  if (event.job_state_changed) $("job-state").textContent = event.job_state_changed.state.replace("STATE_", "");
}

async function openStream() {
  let token;
  try {
    token = (await api("/api/v1/stream-tokens", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ job: jobName() }),
    })).token;
  } catch (error) {
    $("stream-state").textContent = "no event log: " + error.message;
    if (error.status !== 404 && error.message !== "unauthenticated") setTimeout(openStream, 3000);
    else if (error.status === 404) setTimeout(openStream, 5000);
    return;
  }
  const url = "/api/v1/" + jobName() + "/events?token=" + encodeURIComponent(token) + "&after=" + lastSeq;
  const source = new EventSource(url);
  source.onmessage = onEvent;
  source.onopen = () => { $("stream-state").textContent = "live"; };
  source.addEventListener("heartbeat", () => { $("stream-state").textContent = "live (idle)"; });
  source.addEventListener("end", () => { $("stream-state").textContent = "finished"; source.close(); });
  source.addEventListener("failure", (message) => {
    // The events service ended the stream with an error: say which, and try again a little later.
    source.close();
    $("stream-state").textContent = "stream failed: " + JSON.parse(message.data).code;
    setTimeout(openStream, 5000);
  });
  source.onerror = () => {
    // CONNECTING: the browser retries by itself with Last-Event-ID. CLOSED (an expired stream token is
    // refused with 401): open a new stream after the last event seen.
    $("stream-state").textContent = "reconnecting";
    if (source.readyState === EventSource.CLOSED) setTimeout(openStream, 1000);
  };
}

// ---- start ------------------------------------------------------------------------------------------

async function start() {
  const session = await api("/api/v1/session");
  org = session.org;
  $("org").textContent = "orgs/" + org;
  $("login").hidden = true;
  $("content").hidden = false;
  $("logout").hidden = false;
  if (document.body.dataset.page === "jobs") {
    await loadJobs();
    setInterval(() => loadJobs().catch(() => {}), 5000);
  } else {
    $("job-name").textContent = jobName();
    draw();
    await Promise.all([loadJob(), loadCheckpoints().catch(() => {})]);
    setInterval(() => loadJob().catch(() => {}), 5000);
    openStream();
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    start().catch((error) => { $("login-error").textContent = error.message; });
  });
  $("logout").addEventListener("click", () => signOut(""));
  if (sessionStorage.getItem(KEY)) start().catch(() => {});
  else signOut("");
});
