// The console's client side: uPlot charts fed by the server's downsampled series, refreshed on
// server-sent events (coalesced: at most one request in flight per page). No build step.
// A job's page draws everything (header, curves, marks, attempts, checkpoints, incidents) from one
// document, /console/data/jobs/{id}, refetched when /console/events?job={id} says `changed`.
// The pages hold no inline script or style (the Content-Security-Policy forbids them): each names
// itself in `#vigil-page` (data-page and its arguments), and `boot` starts what it needs.
"use strict";
const Vigil = (() => {
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"];
  const MARK_COLOURS = {incident: "#c0392b", halt: "#e67e22", rollback: "#8e44ad", attempt: "#7f8c8d", settings: "#16a085"};
  const state = {charts: {}, data: null, refreshes: 0};

  function events(job) {
    return new EventSource("/console/events" + (job ? "?job=" + encodeURIComponent(job) : ""));
  }

  function reloadOnEvents(names) {
    const es = events(null);
    let timer = null;
    for (const name of names) {
      es.addEventListener(name, () => { if (!timer) timer = setTimeout(() => location.reload(), 1000); });
    }
  }

  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);
  }

  function time(iso) {
    return new Date(iso).toTimeString().slice(0, 8);
  }

  // Every mark of the job as {type, step, label, ...}: drawn on each chart and listed under them.
  function marks(d) {
    const out = [];
    for (const i of d.incidents) {
      if (i.step === null) continue;
      out.push({type: "incident", kind: i.kind, step: i.step,
                label: `incident ${i.kind} at step ${i.step}` + (i.rank !== null ? ` rank ${i.rank}` : "") + ` → ${i.action}`});
    }
    for (const h of d.marks.halts) out.push({type: "halt", step: h.step, label: `halted at step ${h.step}`});
    for (const r of d.marks.rollbacks) {
      const skip = r.skip_data ? `, data ${r.skip_data[0]}..${r.skip_data[1]} skipped` : "";
      out.push({type: "rollback", step: r.from_step, to: r.to_step, skip: r.skip_data,
                label: `rolled back from step ${r.from_step} to ${r.to_step}${skip}`});
    }
    for (const a of d.marks.attempts) {
      if (a.attempt > 1) out.push({type: "attempt", step: a.first_step, label: `attempt ${a.attempt} starts at step ${a.first_step}`});
    }
    for (const c of d.marks.settings || []) {  // guardian settings changed at run time, from the step judged under them
      if (c.from_step === null) continue;
      const what = Object.entries(c.changed).map(([k, v]) => `${k}=${v}`).join(", ");
      out.push({type: "settings", step: c.from_step, label: `guardian settings r${c.revision} (${what}) from step ${c.from_step}, by ${c.actor}`});
    }
    return out.sort((a, b) => a.step - b.step);
  }

  function drawMarks(u, metric) {
    const d = state.data;
    if (!d) return;
    const ctx = u.ctx, top = u.bbox.top, height = u.bbox.height;
    ctx.save();
    for (const m of marks(d)) {
      if (m.type === "rollback" && m.skip) {  // the skipped data window, shaded
        const x0 = u.valToPos(m.skip[0], "x", true), x1 = u.valToPos(m.skip[1], "x", true);
        ctx.fillStyle = "rgba(142, 68, 173, 0.15)";
        ctx.fillRect(x0, top, Math.max(x1 - x0, 2), height);
      }
      const x = u.valToPos(m.step, "x", true);
      ctx.strokeStyle = MARK_COLOURS[m.type];
      ctx.lineWidth = m.type === "incident" ? 2 : 1.5;
      ctx.setLineDash(m.type === "attempt" ? [6, 4] : m.type === "halt" ? [2, 3] : m.type === "settings" ? [8, 2, 2, 2] : []);
      ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
      if (m.type === "incident" || m.type === "settings") {
        ctx.fillStyle = MARK_COLOURS[m.type];
        ctx.font = `${12 * devicePixelRatio}px sans-serif`;
        ctx.fillText(m.type === "incident" ? m.kind : "settings", x + 3, top + (m.type === "incident" ? 12 : 26) * devicePixelRatio);
      }
    }
    ctx.setLineDash([]);
    ctx.fillStyle = "#e74c3c";
    for (const step of d.series.metrics[metric].bad) {  // NaN/Inf values: a red dot on the top edge
      const x = u.valToPos(step, "x", true);
      ctx.beginPath(); ctx.arc(x, top + 4, 4 * devicePixelRatio, 0, 2 * Math.PI); ctx.fill();
    }
    ctx.restore();
  }

  function fmt(v) {  // axis labels: 3 significant digits, small and large values in exponent form
    if (v === null) return "";
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-2 || a >= 1e5) ? v.toExponential(1) : String(+v.toPrecision(3));
  }

  function chartData(s, metric) {
    const m = s.metrics[metric];
    return [s.x, m.mean, m.lo, m.hi, ...m.ranks, m.abandoned];
  }

  function makeChart(el, s, metric, jobId) {
    const band = metric !== "tokens_per_s";
    const opts = {
      title: el.dataset.title,
      width: Math.max(el.clientWidth, 300),
      height: 220,
      scales: {x: {time: false}},
      axes: [{}, {size: 60, values: (u, vals) => vals.map(fmt)}],
      series: [
        {label: "step"},
        {label: metric === "tokens_per_s" ? "sum" : "mean", stroke: "#222", width: 2},
        {label: "min", stroke: band ? "rgba(31,119,180,0.25)" : "transparent", show: band},
        {label: "max", stroke: band ? "rgba(31,119,180,0.25)" : "transparent", show: band},
        ...s.ranks.map((r, i) => ({label: `rank ${r}`, stroke: PALETTE[i % PALETTE.length], width: 1})),
        // the runs an in-place rollback abandoned: faded and dashed beside the re-run, as W&B draws a fork
        {label: "abandoned run", stroke: "rgba(34,34,34,0.3)", width: 2, dash: [6, 4], spanGaps: false},
      ],
      bands: band ? [{series: [3, 2], fill: "rgba(31,119,180,0.12)"}] : [],
      hooks: {draw: [(u) => drawMarks(u, metric)]},
    };
    const u = new uPlot(opts, chartData(s, metric), el);
    u.over.addEventListener("click", () => {
      const i = u.cursor.idx;
      if (i !== null && i !== undefined) location.href = `/jobs/${jobId}/trace?step=${state.data.series.x[i]}`;
    });
    u.vigilRanks = s.ranks.length;
    return u;
  }

  function renderMarks(d) {
    const list = document.getElementById("marks");
    const items = marks(d).map((m) =>
      `<li class="mark ${m.type}${m.kind ? " " + m.type + "-" + m.kind : ""}" data-step="${m.step}">${esc(m.label)}</li>`);
    for (const step of d.series.metrics.loss.bad) items.push(`<li class="mark bad" data-step="${step}">non-finite loss near step ${step}</li>`);
    list.innerHTML = items.join("") || "<li>none</li>";
  }

  function text(id, value) {
    document.getElementById(id).textContent = value;
  }

  function renderHeader(job) {
    const badge = document.getElementById("job-state");
    badge.textContent = job.state;
    badge.className = "state " + job.state;
    text("job-attempt", job.attempt);
    text("job-priority", job.priority);
    text("last-step", job.last_step === null ? "-" : job.last_step);
    text("job-steps", job.steps);
    text("job-loss", job.loss);
    text("job-reason", job.reason ? " · " + job.reason : "");
    document.getElementById("cancel-form").hidden = job.finished;
    const trace = document.querySelector("#trace-form input[name=step]");
    if (!trace.dataset.edited && job.last_step !== null) trace.value = job.last_step;
  }

  // A table's rows, redrawn only when they changed (an open "evidence" stays open while a job trains).
  const TABLES = {
    attempts: {empty: "not launched yet", row: (a) => [a.attempt, time(a.launched_at), esc(a.placement),
      esc(a.resume_from), a.code ? `<code title="${esc(a.code)}">${esc(a.code.slice(0, 12))}</code>` : "-",
      esc(a.ended)]},
    checkpoints: {empty: "none yet", row: (c) => [c.step, c.valid ? "yes" : "no (rolled back past)", esc(c.size),
      c.attempt, `<code>${esc(c.path)}</code>`], cls: (c) => (c.valid ? "valid" : "invalid")},
    incidents: {empty: "none", row: (i, jobId) => [time(i.occurred_at), esc(i.kind),
      i.step === null ? "" : `<a href="/jobs/${encodeURIComponent(jobId)}/trace?step=${i.step}">${i.step}</a>`,
      i.rank ?? "", esc(i.action), esc(i.message) + (i.stacks && i.stacks.length
        ? `<ul class="stacks">${i.stacks.map((g) => `<li>${esc(g)}</li>`).join("")}</ul>` : ""),
      `<details><summary>evidence</summary><pre>${esc(JSON.stringify(i.evidence, null, 2))}</pre></details>`],
      cls: (i) => "incident " + i.kind},
  };

  function renderTable(name, rows, jobId) {
    const table = document.getElementById(name), spec = TABLES[name];
    const key = JSON.stringify(rows);
    if (table.dataset.rendered === key) return;
    const cols = table.querySelectorAll("thead th").length;
    table.tBodies[0].innerHTML = rows.length
      ? rows.map((r) => `<tr class="${spec.cls ? esc(spec.cls(r)) : ""}">` +
                        spec.row(r, jobId).map((c) => `<td>${c}</td>`).join("") + "</tr>").join("")
      : `<tr><td colspan="${cols}">${spec.empty}</td></tr>`;
    table.dataset.rendered = key;
    table.dataset.rows = rows.length;
  }

  function render(d, jobId) {
    const s = d.series;
    for (const el of document.querySelectorAll(".chart[data-metric]")) {
      const metric = el.dataset.metric;
      let u = state.charts[metric];
      if (u && u.vigilRanks !== s.ranks.length) { u.destroy(); u = null; }
      if (u) u.setData(chartData(s, metric)); else state.charts[metric] = makeChart(el, s, metric, jobId);
      el.dataset.lastStep = s.last_step === null ? "" : s.last_step;
      el.dataset.points = s.x.length;
    }
    renderHeader(d.job);
    renderMarks(d);
    text("bucket", s.bucket);
    for (const name of Object.keys(TABLES)) renderTable(name, d[name], jobId);
  }

  function jobPage(jobId) {
    let inFlight = false, again = false;
    const trace = document.querySelector("#trace-form input[name=step]");
    trace.addEventListener("input", () => { trace.dataset.edited = "1"; });
    async function refresh() {
      if (inFlight) { again = true; return; }
      inFlight = true;
      try {
        const resp = await fetch(`/console/data/jobs/${encodeURIComponent(jobId)}`, {credentials: "same-origin"});
        if (resp.status === 401) { location.href = "/login?next=" + encodeURIComponent(location.pathname); return; }
        const d = await resp.json();
        state.data = d;
        state.refreshes += 1;
        render(d, jobId);
      } finally {
        inFlight = false;
        if (again) { again = false; refresh(); }
      }
    }
    // the stream says `changed` with the version the database is at; a document at it is up to date
    events(jobId).addEventListener("changed", (e) => {
      if (!state.data || state.data.version !== e.data) refresh();
    });
    refresh();
  }

  async function gpuPage(node, index) {
    const resp = await fetch(`/console/data/gpus/${encodeURIComponent(node)}/${index}`, {credentials: "same-origin"});
    const d = await resp.json();
    const titles = {utilization_pct: "utilisation %", memory_used_bytes: "memory used (bytes)", temperature_c: "temperature °C", power_w: "power W"};
    for (const key of Object.keys(titles)) {
      const el = document.getElementById("gpu-" + key);
      state.charts[key] = new uPlot({title: titles[key], width: Math.max(el.clientWidth, 300), height: 200,
        series: [{}, {label: titles[key], stroke: "#1f77b4", width: 1.5}]}, [d.t, d[key]], el);
      el.dataset.points = d.t.length;
    }
  }

  function incidentFeed() {
    const body = document.querySelector("#incident-feed tbody");
    events(null).addEventListener("incident.raised", (e) => {
      const i = JSON.parse(e.data);
      const row = document.createElement("tr");
      row.className = "incident " + i.kind;
      const t = new Date(i.occurred_at).toTimeString().slice(0, 8);
      row.innerHTML = [t, `<a href="/jobs/${esc(i.job_id)}">${esc(i.job_id)}</a>`, esc(i.kind), i.step ?? "", i.rank ?? "",
                       esc(i.node ?? ""), esc(i.action), esc(i.message)].map((c) => `<td>${c}</td>`).join("");
      body.prepend(row);
    });
  }

  function boot() {
    for (const select of document.querySelectorAll("select[data-autosubmit]")) {
      select.addEventListener("change", () => select.form.submit());
    }
    for (const el of document.querySelectorAll("[data-colour]")) el.style.background = el.dataset.colour;
    const page = document.getElementById("vigil-page");
    if (!page) return;
    const args = page.dataset;
    switch (args.page) {
      case "jobs": reloadOnEvents(["job.state_changed", "incident.raised"]); break;
      case "cluster": reloadOnEvents(["job.state_changed"]); break;
      case "job": jobPage(args.job); break;
      case "gpu": gpuPage(args.node, Number(args.index)); break;
      case "incidents": incidentFeed(); break;
      case "queue": reloadOnEvents(["job.state_changed"]); break;
    }
  }

  document.addEventListener("DOMContentLoaded", boot);
  return {state, reloadOnEvents, jobPage, gpuPage, incidentFeed};
})();
