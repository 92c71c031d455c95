// Sokuji's dashboard: small helpers and the two chart kinds it draws on canvases
// (a time series, plain or stacked, with an optional target line; a bar chart).
// Plain JavaScript, no library.

export const PALETTE = ["#1f6feb", "#cf222e", "#9a6700", "#8250df", "#1a7f37", "#bf3989",
                               "#0a7ea4", "#6e7781", "#fb8500"];

// --- small helpers ---------------------------------------------------------------------
export function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
export function num(v) { return typeof v === "number" && Number.isFinite(v) ? v : null; }
export function fmt(v, unit) {
  v = num(v);
  if (v === null) return "–";
  if (unit === "%") return `${(v * 100).toFixed(1)}%`;
  if (unit === "x") return `${v.toFixed(2)}×`;
  const a = Math.abs(v);
  const s = a === 0 ? "0" : a < 1 ? v.toFixed(2) : a < 100 ? v.toFixed(1) : v.toFixed(0);
  return unit ? `${s} ${unit}` : s;
}
export function clock(ms) {
  const d = new Date(ms);
  return d.toTimeString().slice(0, 8);
}
function niceCeil(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

// --- a time-series chart on a canvas ---------------------------------------------------
export class Chart {
  // series: [{key, label, color?}]; opts: {unit, stacked, percent, target(), bars}
  constructor(parent, id, title, series, opts) {
    this.opts = opts || {};
    this.series = series.map((s, i) => ({ color: PALETTE[i % PALETTE.length], ...s }));
    this.root = el("div", "chart");
    this.root.dataset.chart = id;
    this.root.append(el("h3", null, title));
    this.canvas = el("canvas");
    this.legend = el("div", "legend");
    this.root.append(this.canvas, this.legend);
    parent.append(this.root);
    this.values = new Map();
    for (const s of this.series) {
      const item = el("span");
      const sw = el("span", "sw");
      sw.style.background = s.color;
      const v = el("span", "v", "–");
      v.dataset.series = s.key;
      item.append(sw, `${s.label} `, v);
      this.legend.append(item);
      this.values.set(s.key, { item, v });
    }
    this.hover = null;
    this.canvas.addEventListener("mousemove", (e) => {
      this.hover = e.offsetX; this.draw();
    });
    this.canvas.addEventListener("mouseleave", () => { this.hover = null; this.draw(); });
  }

  set(ts, cols, t0, t1) {
    this.ts = ts; this.cols = cols; this.t0 = t0; this.t1 = t1;
    this.draw();
  }

  draw() {
    const { ts, cols } = this;
    if (!ts) return;
    const c = this.canvas, dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || 300, h = c.clientHeight || 150;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const L = 48, R = 8, T = 8, B = 18, pw = w - L - R, ph = h - T - B;
    const unit = this.opts.unit || "";
    const stacked = !!this.opts.stacked;
    // stacked: each series drawn on top of the ones before
    const shown = cols.map((col) => col.map(num));
    const tops = stacked ? [] : shown;
    if (stacked) {
      let below = ts.map(() => 0);
      for (const col of shown) {
        const top = col.map((v, i) => (v === null ? below[i] : below[i] + v));
        tops.push(top); below = top;
      }
    }
    let ymax = 0;
    for (const col of tops) for (const v of col) if (v !== null && v > ymax) ymax = v;
    const target = this.opts.target ? num(this.opts.target()) : null;
    if (target !== null) ymax = Math.max(ymax, target * 1.1);
    ymax = this.opts.percent ? 1 : 4 * niceCeil((ymax * 1.05) / 4);
    const x = (t) => L + ((t - this.t0) / Math.max(1, this.t1 - this.t0)) * pw;
    const y = (v) => T + ph - (v / ymax) * ph;
    // grid and labels
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = "#656d76"; g.strokeStyle = "#eaeef2"; g.lineWidth = 1;
    for (let i = 0; i <= 4; i++) {
      const v = (ymax * i) / 4, yy = Math.round(y(v)) + 0.5;
      g.beginPath(); g.moveTo(L, yy); g.lineTo(L + pw, yy); g.stroke();
      g.textAlign = "right"; g.textBaseline = "middle";
      g.fillText(this.opts.percent ? `${Math.round(v * 100)}%` : fmt(v), L - 4, yy);
    }
    g.textAlign = "center"; g.textBaseline = "top";
    for (const f of [0, 0.5, 1]) {
      const t = this.t0 + f * (this.t1 - this.t0);
      g.textAlign = f === 0 ? "left" : f === 1 ? "right" : "center";
      g.fillText(clock(t), L + f * pw, T + ph + 4);
    }
    // series
    const gap = this.opts.gapMs || 2500;  // a longer pause between points breaks the line
    for (let s = shown.length - 1; s >= 0; s--) {
      const color = this.series[s].color, top = tops[s];
      const base = stacked && s > 0 ? tops[s - 1] : null;
      g.strokeStyle = color; g.lineWidth = 1.5;
      let run = [];
      const flush = () => {
        if (!run.length) return;
        if (stacked) {
          g.beginPath();
          run.forEach((i, k) => (k ? g.lineTo(x(ts[i]), y(top[i])) : g.moveTo(x(ts[i]), y(top[i]))));
          for (let k = run.length - 1; k >= 0; k--) {
            const i = run[k];
            g.lineTo(x(ts[i]), y(base ? base[i] : 0));
          }
          g.closePath(); g.globalAlpha = 0.35; g.fillStyle = color; g.fill();
          g.globalAlpha = 1;
        }
        g.beginPath();
        run.forEach((i, k) => (k ? g.lineTo(x(ts[i]), y(top[i])) : g.moveTo(x(ts[i]), y(top[i]))));
        if (run.length === 1) {
          const i = run[0];
          g.fillStyle = color; g.fillRect(x(ts[i]) - 1.5, y(top[i]) - 1.5, 3, 3);
        }
        g.stroke();
        run = [];
      };
      for (let i = 0; i < ts.length; i++) {
        const missing = shown[s][i] === null || ts[i] < this.t0;
        if (missing || (run.length && ts[i] - ts[run[run.length - 1]] > gap)) flush();
        if (!missing) run.push(i);
      }
      flush();
    }
    if (target !== null) {
      g.setLineDash([5, 4]); g.strokeStyle = "#cf222e"; g.lineWidth = 1;
      g.beginPath(); g.moveTo(L, y(target)); g.lineTo(L + pw, y(target)); g.stroke();
      g.setLineDash([]); g.fillStyle = "#cf222e"; g.textAlign = "right";
      g.textBaseline = "bottom"; g.fillText(`target ${fmt(target, unit)}`, L + pw, y(target) - 2);
    }
    // legend: the latest value (the last one there is), or the hovered one
    let at = ts.length - 1;
    if (this.hover !== null && ts.length) {
      const t = this.t0 + ((this.hover - L) / pw) * (this.t1 - this.t0);
      let best = at;
      for (let i = 0; i < ts.length; i++) {
        if (Math.abs(ts[i] - t) < Math.abs(ts[best] - t)) best = i;
      }
      at = best;
      g.strokeStyle = "#8c959f"; g.beginPath();
      g.moveTo(x(ts[at]) + 0.5, T); g.lineTo(x(ts[at]) + 0.5, T + ph); g.stroke();
    }
    this.series.forEach((s, i) => {
      let v = at >= 0 ? cols[i][at] : null;
      if (this.hover === null) {  // not hovering: the last value there is (Grafana's lastNotNull)
        for (let k = at; k >= 0 && num(v) === null; k--) v = cols[i][k];
      }
      const cell = this.values.get(s.key);
      cell.v.textContent = this.opts.percent ? fmt(v, "%") : fmt(v, unit);
    });
  }
}

// --- a bar chart: the batch-size distribution over the window ---------------------------
export class Bars {
  constructor(parent, id, title) {
    this.root = el("div", "chart");
    this.root.dataset.chart = id;
    this.root.append(el("h3", null, title));
    this.canvas = el("canvas");
    this.note = el("div", "legend");
    this.root.append(this.canvas, this.note);
    parent.append(this.root);
  }

  set(bins) {
    const c = this.canvas, dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || 300, h = c.clientHeight || 150;
    c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const total = bins.reduce((a, b) => a + b, 0);
    this.note.textContent = total ? `${total} batches in the window` : "no batches in the window";
    this.note.dataset.total = String(total);
    if (!total) return;
    const L = 8, B = 18, T = 14, pw = w - 2 * L, ph = h - T - B;
    const bw = pw / bins.length, max = Math.max(...bins);
    g.font = "11px system-ui, sans-serif"; g.textAlign = "center";
    bins.forEach((n, i) => {
      const bh = (n / max) * ph, x0 = L + i * bw;
      g.fillStyle = "#1f6feb"; g.fillRect(x0 + 2, T + ph - bh, bw - 4, bh);
      g.fillStyle = "#656d76"; g.textBaseline = "top";
      const lo = i === 0 ? 1 : (1 << (i - 1)) + 1, hi = 1 << i;
      g.fillText(lo === hi ? `${hi}` : `${lo}-${hi}`, x0 + bw / 2, T + ph + 4);
      if (n) { g.textBaseline = "bottom"; g.fillText(String(n), x0 + bw / 2, T + ph - bh - 1); }
    });
  }
}
