// Sokuji's live dashboard: polls /dashboard/data?since=<seq> every second (at once while the
// answer says there is more) and draws each model's figures on canvases. Plain JavaScript,
// no library, nothing from another origin.
import { Bars, Chart, clock, el, fmt, num } from "./charts.js";

const KEY = "sokuji.dashboard.key";
const MAX_POINTS = 900;
const state = { boot: null, seq: null, meta: null, points: [], windowS: 300,
                models: new Map(), sloCharts: new Map(), timer: null };

const $ = (id) => document.getElementById(id);

// --- one model's card ----------------------------------------------------------------------
function sloFor(name) {
  const last = state.points[state.points.length - 1];
  const slos = (last && last.slo) || [];
  const own = slos.filter((s) => s.model === name && num(s.target_p99_ms) !== null);
  if (!own.length) return null;
  return Math.min(...own.map((s) => s.target_p99_ms));
}

function buildModel(m, stages, genStages) {
  const gen = m.apis.includes("generate") && !m.apis.includes("infer");
  const card = el("section", "model");
  card.dataset.model = m.name;
  const head = el("div", "model-head");
  const batch = m.max_batch_size ? ` · max batch ${m.max_batch_size}` : "";
  head.append(el("h2", null, m.name), el("span", "kind", `${m.apis.join("+")} · ${m.runtime}${batch}`));
  const tiles = el("div", "tiles");
  const tileDefs = [["ok", "answers/s", "", true], ["p99", "p99", "ms"],
                    ["err", "5xx/s", "", true], ["shed", "429/s", "", true],
                    ["waiting", "queued", ""]];
  if (gen) tileDefs.push(["ttft_p99", "TTFT p99", "ms"], ["tokens", "tokens/s", "", true]);
  else tileDefs.push(["cache_hit", "cache hits", "%"]);
  const tileCells = tileDefs.map(([key, label, unit, perS]) => {
    const t = el("div", "tile"), v = el("span", "v", "–");
    v.dataset.tile = key;
    t.append(el("span", "k", label), v);
    tiles.append(t);
    return { key, unit, v, perS };
  });
  const grid = el("div", "charts");
  card.append(head, tiles, grid);
  $("models").append(card);
  const id = (k) => `${m.name}/${k}`;
  const charts = [];
  const add = (key, title, series, opts, pick) =>
    charts.push({ chart: new Chart(grid, id(key), title, series, opts), pick });
  const field = (k) => (p) => p[k];
  const rate = (p, key) => (num(p[key]) === null || !(p.dt > 0) ? null : p[key] / p.dt);
  add("throughput", "Throughput (per second)",
      [{ key: "ok", label: "answers" }, { key: "err", label: "5xx" },
       { key: "shed", label: "429" }, { key: "rej", label: "other 4xx" }], { unit: "" }, rate);
  add("latency", gen ? "Latency, arrival to last token (ms)" : "Latency (ms)",
      [{ key: "p50", label: "p50" }, { key: "p95", label: "p95" }, { key: "p99", label: "p99" }],
      { unit: "ms", target: gen ? null : () => sloFor(m.name) });
  const names = gen ? genStages : stages;
  add("stages", "Stages, mean per request (ms, stacked)",
      names.map((s) => ({ key: s, label: s })), { unit: "ms", stacked: true },
      (p, key) => { const a = p[gen ? "gen_stages" : "stages"]; return a ? a[names.indexOf(key)] : null; });
  add("queue", "Queue", [{ key: "waiting", label: "waiting" }, { key: "running", label: "running" }],
      { unit: "" });
  if (gen) {
    add("ttft", "Time to first token (ms)",
        [{ key: "ttft_p50", label: "p50" }, { key: "ttft_p99", label: "p99" }],
        { unit: "ms", target: () => sloFor(m.name) });
    add("itl", "Inter-token latency (ms)",
        [{ key: "itl_p50", label: "p50" }, { key: "itl_p99", label: "p99" }], { unit: "ms" });
    add("tokens", "Tokens generated per second", [{ key: "tokens", label: "tokens/s" }],
        { unit: "" }, rate);
    add("batch", "Decode batch (sequences per step)",
        [{ key: "batch_mean", label: "mean" }], { unit: "" });
    add("steps", "Decode steps per second", [{ key: "batches", label: "steps/s" }],
        { unit: "" }, rate);
    add("cache", "Prefix-cache hit rate", [{ key: "prefix_hit", label: "hits" }],
        { percent: true });
  } else {
    add("batch", "Batch size (items)",
        [{ key: "batch_mean", label: "mean" }, { key: "batch_max", label: "max" }],
        { unit: "" });
    add("cache", "Response-cache hit rate", [{ key: "cache_hit", label: "hits" }],
        { percent: true });
  }
  const bars = gen ? null : new Bars(grid, id("batch-sizes"), "Batch sizes in the window");
  for (const c of charts) c.pick = c.pick || ((p, key) => field(key)(p));
  return { card, charts, bars, tiles: tileCells };
}

// --- SLOs ------------------------------------------------------------------------------
function sloStatus(s) {
  if (!s.requests) return ["none", "no traffic"];
  if (num(s.budget_remaining) !== null && s.budget_remaining < 0) return ["bad", "budget spent"];
  if (s.latency_ok === false || s.errors_ok === false) return ["bad", "missed"];
  if (num(s.burn_rate_short) !== null && s.burn_rate_short > 1) return ["warn", "burning"];
  return ["ok", "met"];
}

function renderSlo(pointsInWindow, t0, t1) {
  const body = $("slo-body");
  const last = state.points[state.points.length - 1];
  const slos = last && Array.isArray(last.slo) ? last.slo : [];
  body.dataset.count = String(slos.length);
  if (!slos.length) {
    if (!body.querySelector(".none")) {
      body.replaceChildren(el("p", "muted none",
        "No SLO configured: give a model slo = {p99_ms = …, error_rate = …, window_s = …} " +
        "(or a tenant an [[slos]] entry) to see its status and error-budget burn here."));
    }
    return;
  }
  let table = body.querySelector("table"), charts = body.querySelector(".charts");
  if (!table) {
    table = el("table");
    const head = el("tr");
    for (const h of ["model", "tenant", "p99 target", "p99 now", "error rate (target)",
                     "requests", "429 shed", "error budget left", "burn long / short", "status"]) {
      head.append(el("th", null, h));
    }
    table.append(el("thead"), el("tbody"));
    table.tHead.append(head);
    charts = el("div", "charts");
    body.replaceChildren(table, charts);
  }
  const rows = slos.map((s) => {
    const tr = el("tr");
    tr.dataset.slo = `${s.model}/${s.tenant || ""}`;
    const [cls, word] = sloStatus(s);
    const budget = num(s.budget_remaining);
    const bar = el("span", "bar"), fill = el("i");
    fill.style.width = `${Math.max(0, Math.min(1, budget === null ? 0 : budget)) * 100}%`;
    if (budget !== null && budget < 0) fill.className = "spent";
    else if (budget !== null && budget < 0.25) fill.className = "low";
    bar.append(fill);
    const budgetCell = el("td");
    budgetCell.append(bar, budget === null ? "–" : `${(budget * 100).toFixed(1)}%`);
    const badge = el("span", `badge ${cls}`, word);
    badge.dataset.status = cls;
    const status = el("td");
    status.append(badge);
    tr.append(el("td", null, s.model), el("td", null, s.tenant || "every tenant"),
              el("td", null, fmt(s.target_p99_ms, "ms")),
              el("td", null, s.p99_ms === null || s.p99_ms === undefined ? "no data" : fmt(s.p99_ms, "ms")),
              el("td", null, `${fmt(s.error_rate, "%")} (${fmt(s.target_error_rate, "%")})`),
              el("td", null, String(s.requests ?? "–")), el("td", null, String(s.shed ?? "–")),
              budgetCell, el("td", null, `${fmt(s.burn_rate, "x")} / ${fmt(s.burn_rate_short, "x")}`),
              status);
    return tr;
  });
  table.tBodies[0].replaceChildren(...rows);
  for (const s of slos) {
    const key = `${s.model}/${s.tenant || ""}`;
    let chart = state.sloCharts.get(key);
    if (!chart) {
      chart = new Chart(charts, `slo/${key}`, `Burn rate: ${s.model}${s.tenant ? ` (${s.tenant})` : ""}`,
                        [{ key: "burn_rate", label: "errors, window" },
                         { key: "burn_rate_short", label: "errors, window/12" },
                         { key: "latency_burn_rate", label: "latency" }],
                        { unit: "x", target: () => 1 });
      state.sloCharts.set(key, chart);
    }
    const find = (p) => (p.slo || []).find((e) => `${e.model}/${e.tenant || ""}` === key) || {};
    chart.set(pointsInWindow.map((p) => p.t),
              chart.series.map((c) => pointsInWindow.map((p) => find(p)[c.key] ?? null)),
              t0, t1);
  }
}

// --- data --------------------------------------------------------------------------------
function reset(doc) {
  state.boot = doc.boot; state.meta = doc; state.points = []; state.seq = null;
  state.models.clear(); state.sloCharts.clear();
  $("models").replaceChildren();
  $("slo-body").replaceChildren();
  for (const m of doc.models) {
    state.models.set(m.name, buildModel(m, doc.stages, doc.gen_stages));
  }
}

function ingest(doc) {
  if (doc.boot !== state.boot) {
    const partial = state.seq !== null;
    reset(doc);
    if (partial) return false;  // a new server run: ask again for everything it has
  }
  for (const p of doc.points) state.points.push(p);
  if (state.points.length > MAX_POINTS) state.points.splice(0, state.points.length - MAX_POINTS);
  state.seq = doc.upto;  // an answer is bounded: the last point sent, not the newest there is
  return true;
}

function render() {
  const pts = state.points;
  if (!pts.length) return;
  const t1 = pts[pts.length - 1].t, t0 = t1 - state.windowS * 1000;
  const inWindow = pts.filter((p) => p.t >= t0);
  const ts = inWindow.map((p) => p.t);
  const last = pts[pts.length - 1];
  for (const [name, card] of state.models) {
    const rows = inWindow.map((p) => ({ ...p.models[name], dt: p.dt }));
    for (const { chart, pick } of card.charts) {
      chart.set(ts, chart.series.map((s) => rows.map((r) => pick(r, s.key) ?? null)), t0, t1);
    }
    if (card.bars) {
      const bins = [];
      for (const r of rows) (r.batch_bins || []).forEach((n, i) => { bins[i] = (bins[i] || 0) + n; });
      card.bars.set(Array.from(bins, (n) => n || 0));
    }
    const now = last.models[name] || {};
    for (const t of card.tiles) {
      const v = t.perS ? (num(now[t.key]) === null ? null : now[t.key] / last.dt) : now[t.key];
      t.v.textContent = fmt(v, t.unit);
    }
  }
  renderSlo(inWindow, t0, t1);
  setStatus("live", `live · ${pts.length} points · last ${clock(last.t)} · sampler ` +
            `${(last.tick_us / 1000).toFixed(2)} ms a tick`);
  document.body.dataset.seq = String(state.seq);  // drawn up to here (tests read these)
  document.body.dataset.points = String(pts.length);
}

function setStatus(cls, text) {
  const s = $("status");
  s.className = `status ${cls}`; s.textContent = text;
}

function askKey(status, message) {
  const panel = $("key-panel");
  panel.hidden = false;
  $("key-reason").textContent = status === 403
    ? `That key may not read these figures: ${message || "it needs an admin key"}`
    : "This server shows its figures to an admin API key only.";
  setStatus("down", status === 403 ? "key refused (403)" : "API key needed (401)");
  $("key-input").focus();
}

function schedule(ms) {
  clearTimeout(state.timer);
  state.timer = setTimeout(poll, ms === undefined ? 1000 : ms);
}

async function poll() {
  const headers = {};
  const key = sessionStorage.getItem(KEY);
  if (key) headers.Authorization = `Bearer ${key}`;
  const url = state.seq === null ? "/dashboard/data" : `/dashboard/data?since=${state.seq}`;
  let r;
  try {
    r = await fetch(url, { headers, cache: "no-store", credentials: "omit" });
  } catch (e) {
    setStatus("down", "server unreachable; retrying");
    return schedule(2000);
  }
  if (r.status === 401 || r.status === 403) {
    let message = "";
    try { message = (await r.json()).error || ""; } catch (e) { message = ""; }
    askKey(r.status, message);
    return;  // until a key is given
  }
  if (!r.ok) {
    setStatus("down", `data: HTTP ${r.status}; retrying`);
    return schedule(2000);
  }
  const doc = await r.json();
  $("key-panel").hidden = true;
  if (!ingest(doc)) return schedule(0);
  if (doc.more) return schedule(0);  // the rest of what the server keeps, then draw
  render();
  schedule();
}

function init() {
  $("window").addEventListener("change", (e) => {
    state.windowS = Number(e.target.value) || 300; render();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("key-input").value = "";
    setStatus("", "trying the key…");
    schedule(0);
  });
  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing); resizing = setTimeout(render, 100);
  });
  state.windowS = Number($("window").value) || 300;
  poll();
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
else init();
