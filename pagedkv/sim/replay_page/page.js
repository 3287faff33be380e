// The simulator replay page: scenario tabs, time slider, play/pause, counters and curves around
// the memory maps of memory.js. Plain JavaScript, no library, no network: it works opened from disk.
(function () {
  "use strict";
  const { fmt, decodeMemory, layoutAt, utilization, geometry, drawMap, sizeCanvas, describeSlot } = replayMaps;
  const doc = JSON.parse(document.getElementById("replay-data").textContent);
  const scenarios = doc.scenarios.map((s) => Object.assign({}, s, { memories: s.memories.map(decodeMemory) }));
  const PLAY_INTERVAL_MS = 50; // one frame per interval while playing
  const pct = (x) => (100 * x).toFixed(1) + "%";

  const tooltip = document.getElementById("tooltip");
  function onHover(view, event) {
    const rect = view.canvas.getBoundingClientRect();
    const g = view.geometry;
    const row = Math.floor((event.clientY - rect.top) / g.cell);
    const col = Math.min(g.slotsPerRow - 1, Math.floor((event.clientX - rect.left) / g.slotPx));
    const text = describeSlot(view, row * g.slotsPerRow + col);
    tooltip.hidden = text === null;
    if (text !== null) {
      tooltip.textContent = text;
      tooltip.style.left = event.clientX + 14 + "px";
      tooltip.style.top = event.clientY + 14 + "px";
    }
  }

  // -- curves ------------------------------------------------------------------------------------
  const PAD = { left: 44, right: 8, top: 20, bottom: 18 };

  function drawChart(canvas, scenario, valueOf, yMax, label, step) {
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    sizeCanvas(canvas, width, height);
    const ctx = canvas.getContext("2d");
    const last = Math.max(1, scenario.steps - 1);
    const x = (s) => PAD.left + ((width - PAD.left - PAD.right) * s) / last;
    const y = (v) => height - PAD.bottom - ((height - PAD.top - PAD.bottom) * v) / yMax;
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#666";
    ctx.strokeStyle = "#ddd";
    ctx.textAlign = "right";
    for (const v of [0, yMax / 2, yMax]) {
      ctx.beginPath();
      ctx.moveTo(PAD.left, y(v));
      ctx.lineTo(width - PAD.right, y(v));
      ctx.stroke();
      ctx.fillText(label(v), PAD.left - 4, y(v) + 4);
    }
    ctx.textAlign = "left";
    ctx.fillText("step 0", PAD.left, height - 4);
    ctx.textAlign = "right";
    ctx.fillText(`step ${fmt(last)}`, width - PAD.right, height - 4);
    ctx.lineWidth = 1.5;
    scenario.memories.forEach((memory) => {
      ctx.strokeStyle = memory.color;
      ctx.beginPath();
      scenario.frames.forEach((s, k) => (k ? ctx.lineTo(x(s), y(valueOf(memory, k))) : ctx.moveTo(x(s), y(valueOf(memory, k)))));
      ctx.stroke();
    });
    ctx.textAlign = "left";
    scenario.memories.forEach((memory, i) => {
      ctx.fillStyle = memory.color;
      ctx.fillText(memory.label, PAD.left + 90 * i, PAD.top - 8);
    });
    ctx.strokeStyle = "#222";
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(x(step), PAD.top);
    ctx.lineTo(x(step), height - PAD.bottom);
    ctx.stroke();
  }

  const runningOf = (memory, k) => memory.series.running[k];
  const utilizationOf = (memory, k) =>
    utilization(memory, memory.series.stored[k], memory.series.held[k], memory.series.waiting[k]);

  // -- the page ----------------------------------------------------------------------------------
  const slider = document.getElementById("frame");
  const playButton = document.getElementById("play");
  const stepLabel = document.getElementById("step-label");
  const memoriesBox = document.getElementById("memories");
  const charts = {
    running: document.getElementById("chart-running"),
    utilization: document.getElementById("chart-utilization"),
  };
  const state = { scenario: null, views: [], playing: false, lastTick: 0 };

  function setCounter(panel, name, value, text) {
    const cell = panel.querySelector(`[data-counter="${name}"]`);
    cell.dataset.value = String(value);
    cell.textContent = text;
  }

  function buildScenario(scenario) {
    state.scenario = scenario;
    document.getElementById("description").textContent = scenario.description;
    for (const button of document.querySelectorAll("#scenarios button")) {
      button.setAttribute("aria-pressed", String(button.dataset.scenario === scenario.id));
    }
    memoriesBox.replaceChildren();
    state.views = scenario.memories.map((memory) => {
      const panel = document.getElementById("memory-template").content.firstElementChild.cloneNode(true);
      panel.dataset.memory = memory.allocator;
      panel.classList.toggle("paged", memory.kind === "paged");
      panel.querySelector(".label").textContent = memory.label;
      panel.querySelector(".swatch").style.background = memory.color;
      const size = panel.querySelector(".size");
      size.textContent = memory.caption;
      if (memory.kind === "paged") size.dataset.poolBlocks = String(memory.num_blocks);
      memoriesBox.appendChild(panel);
      const view = { memory, panel, canvas: panel.querySelector("canvas.map") };
      view.canvas.addEventListener("mousemove", (event) => onHover(view, event));
      view.canvas.addEventListener("mouseleave", () => (tooltip.hidden = true));
      return view;
    });
    layoutMaps();
    slider.max = String(scenario.frames.length - 1);
    slider.value = String(scenario.start_frame);
    render();
  }

  function layoutMaps() {
    const width = state.views[0].canvas.clientWidth;
    const g = geometry(state.scenario, width);
    for (const view of state.views) {
      view.geometry = g;
      sizeCanvas(view.canvas, width, Math.ceil(view.memory.capacity_slots / g.slotsPerRow) * g.cell);
    }
  }

  function render() {
    const scenario = state.scenario;
    const frame = Number(slider.value);
    const step = scenario.frames[frame];
    stepLabel.dataset.step = String(step);
    stepLabel.textContent = `step ${fmt(step)} of ${fmt(scenario.steps - 1)} (frame ${frame + 1} of ${scenario.frames.length})`;
    for (const view of state.views) {
      const waiting = view.memory.series.waiting[frame];
      const layout = layoutAt(view.memory, step, waiting, scenario.block_size);
      drawMap(view, layout, view.geometry);
      const panel = view.panel;
      const capacity = view.memory.capacity_slots;
      setCounter(panel, "running", layout.live.length, fmt(layout.live.length));
      setCounter(panel, "waiting", waiting, fmt(waiting));
      setCounter(panel, "stored", layout.stored, fmt(layout.stored));
      setCounter(panel, "held", layout.held, `${fmt(layout.held)} of ${fmt(capacity)} (${pct(layout.held / capacity)})`);
      setCounter(panel, "utilization", layout.utilization.toFixed(6), pct(layout.utilization));
      if (view.memory.kind === "paged") {
        setCounter(panel, "blocks", layout.blocks, `${fmt(layout.blocks)} of ${fmt(view.memory.num_blocks)}`);
      }
    }
    const maxRunning = Math.max(1, ...scenario.memories.flatMap((m) => m.series.running));
    drawChart(charts.running, scenario, runningOf, maxRunning, fmt, step);
    drawChart(charts.utilization, scenario, utilizationOf, 1, (v) => `${Math.round(100 * v)}%`, step);
  }

  function seekToStep(step) {
    const frames = state.scenario.frames;
    let best = 0;
    for (let k = 1; k < frames.length; k++) if (Math.abs(frames[k] - step) < Math.abs(frames[best] - step)) best = k;
    slider.value = String(best);
    render();
  }

  function setPlaying(playing) {
    state.playing = playing;
    playButton.innerHTML = playing ? "&#10074;&#10074; Pause" : "&#9654; Play";
    playButton.dataset.playing = String(playing);
    if (playing) requestAnimationFrame(tick);
  }

  function tick(now) {
    if (!state.playing) return;
    if (now - state.lastTick >= PLAY_INTERVAL_MS) {
      state.lastTick = now;
      const next = Number(slider.value) + 1;
      if (next > Number(slider.max)) return setPlaying(false);
      slider.value = String(next);
      render();
    }
    requestAnimationFrame(tick);
  }

  // -- wiring ------------------------------------------------------------------------------------
  document.getElementById("title").textContent = doc.title;
  document.getElementById("subtitle").textContent = doc.subtitle;
  const nav = document.getElementById("scenarios");
  for (const scenario of scenarios) {
    const button = document.createElement("button");
    button.type = "button";
    button.dataset.scenario = scenario.id;
    button.textContent = scenario.label;
    button.addEventListener("click", () => {
      setPlaying(false);
      buildScenario(scenario);
    });
    nav.appendChild(button);
  }
  slider.addEventListener("input", render);
  playButton.addEventListener("click", () => {
    if (!state.playing && Number(slider.value) >= Number(slider.max)) slider.value = "0";
    setPlaying(!state.playing);
  });
  for (const canvas of Object.values(charts)) {
    canvas.addEventListener("click", (event) => {
      const rect = canvas.getBoundingClientRect();
      const fraction = (event.clientX - rect.left - PAD.left) / (rect.width - PAD.left - PAD.right);
      seekToStep(Math.round(Math.min(1, Math.max(0, fraction)) * Math.max(1, state.scenario.steps - 1)));
    });
  }
  window.addEventListener("resize", () => {
    layoutMaps();
    render();
  });
  buildScenario(scenarios[0]);
})();
