// Memory maps of the simulator replay: decode one allocator's packed residencies (one record per
// admission; see pagedkv/sim/replay.py), derive its layout at any step, draw it, name a slot's owner.
// Plain JavaScript, no library; page.js drives it.
const replayMaps = (function () {
  "use strict";
  const MAP_HEIGHT = 300; // CSS pixels the largest memory of a scenario is fitted into
  const fmt = (n) => Math.round(n).toLocaleString("en-US");

  // -- decoding ---------------------------------------------------------------------------------
  // Columns are base64 little-endian uint16/uint32 arrays; DataView reads them on any platform.
  function unpack(packed) {
    const text = atob(packed.data);
    const view = new DataView(new ArrayBuffer(text.length));
    for (let i = 0; i < text.length; i++) view.setUint8(i, text.charCodeAt(i));
    const width = packed.type === "u16" ? 2 : 4;
    const out = new Uint32Array(text.length / width);
    for (let i = 0; i < out.length; i++) {
      out[i] = width === 2 ? view.getUint16(2 * i, true) : view.getUint32(4 * i, true);
    }
    return out;
  }

  function decodeMemory(memory) {
    const cols = {};
    for (const [name, packed] of Object.entries(memory.residencies)) cols[name] = unpack(packed);
    if (memory.kind === "paged") {
      cols.offset = new Uint32Array(memory.count + 1); // where each residency's block ids start
      for (let i = 0; i < memory.count; i++) cols.offset[i + 1] = cols.offset[i] + cols.num_blocks[i];
    }
    return Object.assign({}, memory, { cols });
  }

  // -- the state of one memory at one step -------------------------------------------------------
  // A residency holds tokens + (t - admitted) tokens (at most final_len) while admitted <= t < left;
  // paged, the first ceil(stored / block_size) of its block ids.
  function layoutAt(memory, step, waiting, blockSize) {
    const c = memory.cols;
    const live = [];
    let stored = 0;
    let held = 0;
    let blocks = 0;
    for (let i = 0; i < memory.count && c.admitted[i] <= step; i++) {
      if (step >= c.left[i]) continue;
      const tokens = Math.min(c.tokens[i] + step - c.admitted[i], c.final_len[i]);
      live.push({ index: i, tokens });
      stored += tokens;
      if (memory.kind === "paged") {
        const n = Math.ceil(tokens / blockSize);
        blocks += n;
        held += n * blockSize;
      } else {
        held += c.size[i];
      }
    }
    return { live, stored, held, blocks, waiting, utilization: utilization(memory, stored, held, waiting) };
  }

  // Token states over the memory that is not idle: free slots count as external fragmentation
  // while requests wait (the trace's definition, pagedkv/sim/trace.py).
  function utilization(memory, stored, held, waiting) {
    const notIdle = waiting > 0 ? memory.capacity_slots : held;
    return notIdle > 0 ? stored / notIdle : 1;
  }

  // -- colours and patterns ----------------------------------------------------------------------
  // Golden-angle hues keep neighbouring request ids apart; the offset keeps request 0 off the reds
  // that mean waste.
  const hue = (request) => (200 + request * 137.508) % 360;
  const solid = (request) => `hsl(${hue(request)}, 62%, 47%)`;
  const pale = (request) => `hsl(${hue(request)}, 70%, 87%)`;
  const FREE = "#eeeeee";

  function stripes(color) {
    const tile = document.createElement("canvas");
    tile.width = tile.height = 6;
    const g = tile.getContext("2d");
    g.fillStyle = "#ffffff";
    g.fillRect(0, 0, 6, 6);
    g.strokeStyle = color;
    g.lineWidth = 1.5;
    g.beginPath();
    for (const d of [-6, 0, 6]) {
      g.moveTo(d, 6);
      g.lineTo(d + 6, 0);
    }
    g.stroke();
    return tile;
  }
  const tiles = { internal: stripes("#d7191c"), external: stripes("#7b3294") };

  // -- memory maps -------------------------------------------------------------------------------
  // One geometry per scenario: the same number of slots per row in every map, so that memory
  // sizes compare at a glance; a paged block is a square cell.
  function geometry(scenario, width) {
    const bs = scenario.block_size;
    const largest = Math.max(...scenario.memories.map((m) => m.capacity_slots));
    const blocksPerRow = Math.max(1, Math.round(Math.sqrt((largest * width) / (bs * MAP_HEIGHT))));
    const cell = width / blocksPerRow;
    return { bs, blocksPerRow, slotsPerRow: blocksPerRow * bs, cell, slotPx: cell / bs, gap: cell >= 6 ? 1 : 0 };
  }

  function fillSlots(ctx, g, from, to, style) {
    ctx.fillStyle = style;
    let a = from;
    while (a < to) {
      const row = Math.floor(a / g.slotsPerRow);
      const x0 = a - row * g.slotsPerRow;
      const n = Math.min(g.slotsPerRow - x0, to - a);
      ctx.fillRect(x0 * g.slotPx, row * g.cell, n * g.slotPx, g.cell - g.gap);
      a += n;
    }
  }

  function fillBlock(ctx, g, block, tokens, style, rest) {
    const row = Math.floor(block / g.blocksPerRow);
    const x = (block - row * g.blocksPerRow) * g.cell;
    const size = g.cell - g.gap;
    const used = (size * tokens) / g.bs;
    if (used > 0) {
      ctx.fillStyle = style;
      ctx.fillRect(x, row * g.cell, used, size);
    }
    if (used < size) {
      ctx.fillStyle = rest;
      ctx.fillRect(x + used, row * g.cell, size - used, size);
    }
  }

  function drawMap(view, layout, g) {
    const { memory, canvas } = view;
    const ctx = canvas.getContext("2d");
    const patterns = {
      internal: ctx.createPattern(tiles.internal, "repeat"),
      external: ctx.createPattern(tiles.external, "repeat"),
    };
    const idle = layout.waiting > 0 ? patterns.external : FREE;
    const c = memory.cols;
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    if (memory.kind === "paged") {
      const owner = new Int32Array(memory.num_blocks).fill(-1);
      for (let b = 0; b < memory.num_blocks; b++) fillBlock(ctx, g, b, 0, idle, idle);
      for (const { index, tokens } of layout.live) {
        const n = Math.ceil(tokens / g.bs);
        for (let j = 0; j < n; j++) {
          const block = c.blocks[c.offset[index] + j];
          owner[block] = index;
          fillBlock(ctx, g, block, Math.min(g.bs, tokens - j * g.bs), solid(c.request[index]), patterns.internal);
        }
      }
      view.owner = owner;
    } else {
      fillSlots(ctx, g, 0, memory.capacity_slots, idle);
      for (const { index, tokens } of layout.live) {
        const start = c.start[index];
        const end = start + c.size[index];
        const final = Math.min(start + c.final_len[index], end);
        fillSlots(ctx, g, start, start + tokens, solid(c.request[index]));
        fillSlots(ctx, g, start + tokens, final, pale(c.request[index]));
        fillSlots(ctx, g, final, end, patterns.internal);
      }
    }
    view.layout = layout;
  }

  function sizeCanvas(canvas, cssWidth, cssHeight) {
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(cssWidth * ratio);
    canvas.height = Math.max(1, Math.round(cssHeight * ratio));
    canvas.style.height = cssHeight + "px";
    canvas.getContext("2d").setTransform(ratio, 0, 0, ratio, 0, 0);
  }

  // -- hover: who holds this slot ------------------------------------------------------------------
  function describeSlot(view, slot) {
    const { memory, layout } = view;
    const c = memory.cols;
    const bs = view.geometry.bs;
    if (slot < 0 || slot >= memory.capacity_slots) return null;
    if (memory.kind === "paged") {
      const block = Math.floor(slot / bs);
      const index = view.owner[block];
      if (index < 0) return `block ${fmt(block)}: free`;
      const tokens = layout.live.find((l) => l.index === index).tokens;
      const position = c.blocks.subarray(c.offset[index], c.offset[index + 1]).indexOf(block);
      const filled = Math.min(bs, tokens - position * bs);
      return (
        `block ${fmt(block)}: request ${c.request[index]}, its block ${position}\n` +
        `${filled} of ${bs} slots filled; ${fmt(tokens)} of ${fmt(c.final_len[index])} tokens stored`
      );
    }
    for (const { index, tokens } of layout.live) {
      const start = c.start[index];
      if (slot >= start && slot < start + c.size[index]) {
        return (
          `slot ${fmt(slot)}: request ${c.request[index]}\n` +
          `region of ${fmt(c.size[index])} slots at ${fmt(start)}; ` +
          `${fmt(tokens)} of ${fmt(c.final_len[index])} tokens stored`
        );
      }
    }
    return `slot ${fmt(slot)}: free`;
  }

  return { fmt, decodeMemory, layoutAt, utilization, geometry, drawMap, sizeCanvas, describeSlot };
})();
