"use strict";
/* charts.js: small line charts over the last minute of frames, drawn on canvases. */

const WINDOW_S = 60;

class Chart {
  constructor(parent, title, lines, unit) {
    this.lines = lines;  // [{name, colour}]
    this.unit = unit;
    this.points = [];    // [t, [values...]]
    const box = document.createElement("div");
    box.className = "chart";
    box.innerHTML = `<h3>${title}: <b></b></h3><canvas></canvas>`;
    parent.appendChild(box);
    this.label = box.querySelector("b");
    this.canvas = box.querySelector("canvas");
  }

  push(t, values) {
    this.points.push([t, values]);
    while (this.points.length && this.points[0][0] < t - WINDOW_S) this.points.shift();
    this.label.textContent = values.map((v, k) => `${this.lines[k].name}${format(v)}${this.unit}`).join(" · ");
  }

  clear() { this.points = []; }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (canvas.width !== width * ratio) { canvas.width = width * ratio; canvas.height = height * ratio; }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.strokeStyle = "#d8d8d4";
    ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
    if (!this.points.length) return;
    // The last minute, or as much as there is of it, across the whole width.
    const end = this.points[this.points.length - 1][0];
    const span = Math.max(1, Math.min(WINDOW_S, end - this.points[0][0]));
    const start = end - span;
    let top = 1;
    for (const [, values] of this.points) for (const v of values) top = Math.max(top, v);
    this.lines.forEach((line, k) => {
      ctx.strokeStyle = line.colour;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      this.points.forEach(([t, values], n) => {
        const x = ((t - start) / span) * (width - 2) + 1;
        const y = height - 2 - (values[k] / top) * (height - 6);
        if (n === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke();
    });
  }
}

function format(value) {
  return Number.isInteger(value) ? String(value) : value.toFixed(1);
}

/* The five series, fed from each frame's counters (rates from the change since the last frame). */
const RATE_WINDOW_S = 1;

const Charts = {
  charts: null,
  recent: [],  // the counters of the last RATE_WINDOW_S seconds, for tokens/s

  init(parent) {
    this.charts = {
      kv: new Chart(parent, "KV blocks in use", [{ name: "", colour: "#0969da" }], " %"),
      queues: new Chart(parent, "requests", [
        { name: "running ", colour: "#2da44e" }, { name: "waiting ", colour: "#cf222e" }], ""),
      preemptions: new Chart(parent, "preemptions (total)", [{ name: "", colour: "#8250df" }], ""),
      hits: new Chart(parent, "prefix-cache hit rate", [{ name: "", colour: "#bf8700" }], " %"),
      tokens: new Chart(parent, "generated tokens/s", [{ name: "", colour: "#1f2328" }], ""),
    };
  },

  reset() {
    for (const chart of Object.values(this.charts)) chart.clear();
    this.recent = [];
  },

  add(stats, config) {
    const c = this.charts;
    this.recent.push(stats);
    while (this.recent.length > 2 && this.recent[1].t <= stats.t - RATE_WINDOW_S) this.recent.shift();
    const before = this.recent[0];
    c.kv.push(stats.t, [(100 * stats.used) / config.numBlocks]);
    c.queues.push(stats.t, [stats.running, stats.waiting]);
    c.preemptions.push(stats.t, [stats.preemptions]);
    c.hits.push(stats.t, [stats.prefixQueries ? (100 * stats.prefixHits) / stats.prefixQueries : 0]);
    if (before && stats.t > before.t && stats.generated >= before.generated) {
      c.tokens.push(stats.t, [Math.round((stats.generated - before.generated) / (stats.t - before.t))]);
    }
    for (const chart of Object.values(c)) chart.draw();
  },
};
