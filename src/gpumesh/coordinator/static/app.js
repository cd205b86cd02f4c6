// The gpumesh dashboard: short polling of /ui/api, every element built with textContent.
// No user-supplied string (job names, hostnames, output, error text) is ever parsed as
// HTML: el() turns strings into text nodes, and attributes are set one by one.
"use strict";

const POLL_MS = 1000;
// Where the coordinator's routes start: "" at the root, "/gpumesh" behind a proxy's prefix
const BASE = location.pathname.replace(/\/ui\/?$/, "");
let csrf = "";
let me = null;
let timer = null;
let openErrors = new Set();   // task ids whose error details are shown
// A job page shows one page of its tasks (and of its output) at a time: a big job is
// never sent whole. Each list keeps the cursors of the pages it went through; the last
// is the one shown ("after" index, -1 for the first page).
const TASK_STATES = ["pending", "leased", "done", "failed", "cancelled"];
let taskFilter = "all";
let taskCursors = [-1];
let outputCursors = [-1];
let jobCursors = [""];  // the job list's pages: "" the newest, then ?before= a job id

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) throw new Error("no inline handlers");
    node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function replace(container, ...nodes) {
  container.replaceChildren(...nodes.flat(Infinity).filter(Boolean));
}

async function api(path, opts = {}) {
  const headers = Object.assign({}, opts.headers || {});
  if (opts.method && opts.method !== "GET") headers["X-CSRF-Token"] = csrf;
  const r = await fetch(path, Object.assign({}, opts, { headers, credentials: "same-origin" }));
  if (r.status === 401) { showSignin(); throw new Error("signed out"); }
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.message || ("HTTP " + r.status));
  return body;
}

// ------------------------------------------------------------------ formatting -------
function ago(s) {
  if (s < 1) return "now";
  if (s < 90) return Math.round(s) + "s ago";
  if (s < 5400) return Math.round(s / 60) + "m ago";
  return Math.round(s / 3600) + "h ago";
}
function dur(s) {
  if (s === null || s === undefined) return "";
  if (s < 10) return s.toFixed(2) + "s";
  if (s < 600) return s.toFixed(0) + "s";
  return (s / 60).toFixed(1) + "m";
}
function hours(h) {
  const s = h * 3600;
  if (s < 60) return Math.round(s) + " s";
  if (s < 3600) return (s / 60).toFixed(1) + " min";
  return h.toFixed(2) + " h";
}
function mib(n) { return n >= 1024 ? (n / 1024).toFixed(1) + " GiB" : Math.round(n) + " MiB"; }
function state(s) { return el("span", { class: "state " + s, "data-state": s }, s); }
function finalOf(c) { return (c.done || 0) + (c.failed || 0) + (c.cancelled || 0); }

function bar(counts, n) {
  const b = el("div", { class: "bar", role: "progressbar", "aria-valuemin": 0,
                         "aria-valuemax": n, "aria-valuenow": finalOf(counts) });
  for (const k of ["done", "failed", "cancelled", "leased"]) {
    if (counts[k] && n) {
      const s = el("span", { class: k });
      s.style.width = (100 * counts[k] / n) + "%";
      b.appendChild(s);
    }
  }
  return b;
}

// ------------------------------------------------------------------ sign-in ----------
function showSignin(message) {
  stop();
  me = null;
  document.getElementById("signin").hidden = false;
  document.getElementById("signout").hidden = true;
  document.getElementById("me").textContent = "";
  replace(document.getElementById("view"));
  document.getElementById("signin-error").textContent = message || "";
}

async function signin(ev) {
  ev.preventDefault();
  const token = document.getElementById("token").value.trim();
  const r = await fetch(BASE + "/ui/login", { method: "POST", credentials: "same-origin",
                                       headers: { "Content-Type": "application/json" },
                                       body: JSON.stringify({ token }) });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) { showSignin(body.message || ("HTTP " + r.status)); return; }
  document.getElementById("token").value = "";
  document.getElementById("signin").hidden = true;
  csrf = body.csrf;
  route();
}

async function signout() {
  try { await api(BASE + "/ui/logout", { method: "POST" }); } catch (e) { /* signed out anyway */ }
  showSignin();
}

// ------------------------------------------------------------------ pool page --------
function workerRow(w) {
  const gpus = (w.gpus || []).map(g => {
    const bits = [g.name || "GPU"];
    if (g.memory_total_mb) {
      const free = g.memory_free_mb ?? g.memory_total_mb;
      bits.push(mib(g.memory_total_mb - free) + " used / " + mib(free) + " free");
    }
    if (g.utilization_pct !== undefined) bits.push(g.utilization_pct + "% busy");
    if (g.temperature_c !== undefined) bits.push(g.temperature_c + " °C");
    return el("div", { class: "gpu" }, bits.join(" · "));
  });
  const owner = (w.owner_labels || []).join(", ");
  return el("tr", { class: "worker", "data-id": w.id },
    el("td", {}, el("strong", { class: "hostname" }, w.hostname || w.id),
       el("span", { class: "muted" }, " " + w.id.slice(0, 8)),
       el("div", { class: "muted" }, w.device_name || w.device || "")),
    el("td", {}, state(w.alive ? "alive" : "dead"),
       owner ? el("div", { class: "muted owner-state" }, owner) : null,
       w.allow_installs ? el("div", { class: "muted installs" }, "installs") : null),
    el("td", {}, (w.running || 0) + " / " + (w.slots || 0)),
    // (not measured yet: "pending", as `gpumesh workers` says)
    el("td", { class: "hide-narrow" }, w.score == null ? "pending" : w.score.toFixed(3)),
    el("td", {}, gpus.length ? gpus : el("span", { class: "muted" }, "CPU only")),
    el("td", { class: "hide-narrow" }, w.version || ""),
    el("td", { class: "hide-narrow" }, ago(w.last_seen_s || 0)));
}

function poolPage(s) {
  const workers = el("section", { id: "workers" }, el("h2", {}, "Pool (" +
      s.workers.filter(w => w.alive).length + " alive, " + s.queue_depth + " queued)"),
    el("table", {}, el("thead", {}, el("tr", {}, ["Machine", "State", "Busy / slots", "Score",
        "GPUs", "Version", "Heartbeat"].map((h, i) => el("th", i === 3 || i > 4 ? { class: "hide-narrow" } : {}, h)))),
      el("tbody", {}, s.workers.map(workerRow))));
  const ppl = el("section", { id: "people" }, el("h2", {}, "People"),
    s.people.length ? el("table", {}, el("thead", {}, el("tr", {},
        ["Person", "Running", "Queued", "GPU today", "GPU this week", "CPU today", "CPU this week"]
          .map((h, i) => el("th", i > 4 ? { class: "hide-narrow" } : {}, h)))),
      el("tbody", {}, s.people.map(p => el("tr", { class: "person" },
        el("td", {}, p.person), el("td", {}, p.running), el("td", {}, p.queued),
        el("td", {}, hours(p.gpu_hours_day)), el("td", {}, hours(p.gpu_hours_week)),
        el("td", {}, hours(p.cpu_hours_day)), el("td", { class: "hide-narrow" }, hours(p.cpu_hours_week))))))
      : el("p", { class: "muted" }, "Nobody has run anything yet."));
  const jobs = el("section", { id: "jobs" }, el("h2", {}, "Jobs"),
    s.jobs.length ? el("table", {}, el("thead", {}, el("tr", {},
        ["Job", "Owner", "State", "Progress", ""].map(h => el("th", {}, h)))),
      el("tbody", {}, s.jobs.map(j => el("tr", { class: "job-row", "data-id": j.id },
        el("td", {}, el("a", { class: "job-link", href: "#/job/" + j.id }, j.name || j.id),
           el("div", { class: "muted" }, j.id)),
        el("td", { class: "owner" }, j.owner),
        el("td", {}, state(j.state)),
        el("td", {}, bar(j.counts, j.n_tasks)),
        el("td", { class: "progress" }, finalOf(j.counts) + "/" + j.n_tasks))))
      ) : el("p", { class: "muted" }, jobCursors.length > 1 ? "No older jobs." : "No jobs yet."),
    pager("jobs", jobCursors, s.jobs_next, c => { jobCursors = c; }, ["← Newer", "Older →"]));
  return [workers, ppl, jobs];
}

// ------------------------------------------------------------------ job page ---------
function taskRow(t, mayRead) {
  const row = el("tr", { class: "task-row", "data-index": t.index, "data-state": t.state },
    el("td", {}, "#" + t.index), el("td", {}, state(t.state)),
    el("td", {}, t.worker ? (t.host ? t.host + " " : "") + t.worker.slice(0, 8) : ""),
    el("td", {}, dur(t.duration_s)), el("td", {}, t.attempts));
  const cell = el("td", {});
  if (t.error) {
    const open = openErrors.has(t.id);
    const btn = el("button", { type: "button", class: "link task-error", "data-task": t.id },
                   (t.error.type || t.error.kind || "error") + (open ? " ▾" : " ▸"));
    btn.addEventListener("click", () => {
      if (openErrors.has(t.id)) openErrors.delete(t.id); else openErrors.add(t.id);
      tick();
    });
    cell.appendChild(btn);
    if (open) {
      cell.appendChild(el("div", { class: "error-message" }, t.error.message ||
        (mayRead ? "" : "(the message is for the job's owner)")));
      // a function's remote traceback, or what a failed script wrote to stderr
      const tb = t.error.traceback || t.error.stderr_tail;
      if (tb) cell.appendChild(el("pre", { class: "traceback" }, tb));
    }
  }
  row.appendChild(cell);
  return row;
}

async function act(jobId, what) {
  const msg = document.getElementById("action-message");
  try {
    const r = await api(BASE + "/ui/api/jobs/" + jobId + "/" + what, { method: "POST" });
    msg.textContent = what === "cancel" ? "Cancelled " + r.cancelled + " task(s)."
                                        : "Re-queued " + r.retried + " task(s).";
  } catch (e) {
    msg.textContent = e.message;
  }
  tick();
}

function jobPage(j, out) {
  const head = el("section", { id: "job", "data-id": j.id, "data-state": j.state },
    el("h1", { id: "job-name" }, j.name || j.id),
    el("p", { class: "muted" }, j.id + " · " + j.kind + " · owner ", el("strong", { id: "job-owner" }, j.owner)),
    el("div", { class: "actions" }, state(j.state),
       el("span", { id: "job-progress" }, finalOf(j.counts) + "/" + j.n_tasks),
       Object.entries(j.counts).map(([k, v]) => el("span", { class: "muted" }, k + "=" + v))),
    bar(j.counts, j.n_tasks));
  if (j.may_act) {
    const buttons = el("div", { class: "actions" });
    if (j.state === "active") {
      const c = el("button", { type: "button", id: "cancel-btn", class: "danger" }, "Cancel job");
      c.addEventListener("click", () => act(j.id, "cancel"));
      buttons.appendChild(c);
    }
    // (a function call's or .map's results belong to its caller: only a script job re-runs)
    if (j.kind === "script" && (j.counts.failed || 0) > 0) {
      const r = el("button", { type: "button", id: "retry-btn" }, "Retry failed tasks");
      r.addEventListener("click", () => act(j.id, "retry"));
      buttons.appendChild(r);
    }
    head.appendChild(buttons);
  }
  head.appendChild(el("p", { id: "action-message", class: "muted", role: "status" }));
  // which tasks: all, or those in one state (each button with its count)
  const filters = el("div", { id: "task-filters", class: "actions" },
    ["all", ...TASK_STATES].filter(k => k === "all" || k === taskFilter || (j.counts[k] || 0) > 0)
      .map(k => {
        const b = el("button", { type: "button", class: "filter" + (k === taskFilter ? " active" : ""),
                                 "data-filter": k, "aria-pressed": k === taskFilter ? "true" : "false" },
                     k + " " + (k === "all" ? j.n_tasks : (j.counts[k] || 0)));
        b.addEventListener("click", () => { taskFilter = k; taskCursors = [-1]; tick(); });
        return b;
      }));
  const shown = j.tasks.length ? "#" + j.tasks[0].index + "–#" + j.tasks[j.tasks.length - 1].index
                               : "none";
  const tasks = el("section", { id: "tasks" }, el("h2", {}, "Tasks"), filters,
    el("p", { id: "tasks-shown", class: "muted" }, "Showing " + j.tasks.length + " (" + shown + ") of " +
       (taskFilter === "all" ? j.n_tasks : (j.counts[taskFilter] || 0)) +
       (taskFilter === "all" ? "" : " " + taskFilter)),
    el("table", {}, el("thead", {}, el("tr", {}, ["Task", "State", "Worker", "Duration",
        "Attempts", "Error"].map(h => el("th", {}, h)))),
      el("tbody", {}, j.tasks.map(t => taskRow(t, j.may_read)))),
    pager("tasks", taskCursors, j.page.next_after, c => { taskCursors = c; }));
  const output = el("section", { id: "output" },
    el("h2", {}, "Output", out && out.printed ? el("span", { id: "output-count", class: "muted" },
       " (" + out.printed + " task" + (out.printed === 1 ? "" : "s") + " printed)") : null),
    !j.may_read ? el("p", { class: "muted" }, "Output is for the job's owner.")
      : (out && out.tasks.length) ? out.tasks.map(t => [
          el("h3", { class: "muted" }, "#" + t.index),
          t.runs.map(r => [
            // a task that ran more than once: each attempt's output under its own line
            t.attempts > 1 ? el("p", { class: "muted attempt" }, "attempt " + r.attempt + " on " +
              (r.hostname || r.worker || "?") + ": " + (r.ended || "?")) : null,
            r.stdout ? el("pre", { class: "stdout" }, r.stdout) : null,
            r.stderr ? el("pre", { class: "stderr" }, r.stderr) : null])])
      : el("p", { class: "muted" }, "Nothing printed yet."),
    out ? pager("output", outputCursors, out.next_after, c => { outputCursors = c; }) : null);
  return [el("p", {}, el("a", { href: "#/" }, "← pool and jobs")), head, tasks, output];
}

// Previous / next buttons of a paged list: `cursors` are the pages gone through (the
// last is shown), `next` the cursor of the page after it (null: this is the last).
function pager(name, cursors, next, set, labels = ["← Previous", "Next →"]) {
  if (cursors.length === 1 && (next === null || next === undefined)) return null;
  const prev = el("button", { type: "button", id: name + "-prev", disabled: cursors.length === 1 },
                  labels[0]);
  prev.addEventListener("click", () => { set(cursors.slice(0, -1)); tick(); });
  const more = el("button", { type: "button", id: name + "-next",
                              disabled: next === null || next === undefined }, labels[1]);
  more.addEventListener("click", () => { set([...cursors, next]); tick(); });
  return el("div", { class: "actions pager" }, prev, more);
}

// ------------------------------------------------------------------ loop -------------
function stop() { if (timer) { clearTimeout(timer); timer = null; } }

async function tick() {
  stop();
  const view = document.getElementById("view");
  const m = location.hash.match(/^#\/job\/([0-9a-f]{4,64})$/);
  try {
    const older = jobCursors[jobCursors.length - 1];
    const s = await api(BASE + "/ui/api/state" + (older && !m ? "?before=" + older : ""));
    me = s.me; csrf = s.me.csrf;
    document.getElementById("me").textContent = me.name + " (" + me.role + ")";
    document.getElementById("signout").hidden = false;
    document.getElementById("signin").hidden = true;
    if (m) {
      const at = c => c[c.length - 1];
      const j = await api(BASE + "/ui/api/jobs/" + m[1] + "?state=" + taskFilter +
                          "&after=" + at(taskCursors));
      const out = j.may_read ? await api(BASE + "/ui/api/jobs/" + m[1] + "/output?after=" +
                                         at(outputCursors)) : null;
      const msg = document.getElementById("action-message");
      const keep = msg ? msg.textContent : "";
      replace(view, jobPage(j, out));
      document.getElementById("action-message").textContent = keep;
    } else {
      replace(view, poolPage(s));
    }
  } catch (e) {
    if (e.message === "signed out") return;
    if (!m && jobCursors.length > 1) jobCursors = [""];  // (its cursor job was purged: the newest again)
    replace(view, el("p", { class: "error", role: "alert" }, e.message));
  }
  timer = setTimeout(tick, POLL_MS);
}

function route() {
  openErrors = new Set();
  taskFilter = "all"; taskCursors = [-1]; outputCursors = [-1];
  tick();
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("signin").addEventListener("submit", signin);
  document.getElementById("signout").addEventListener("click", signout);
  window.addEventListener("hashchange", route);
  tick();
});
