"use strict";
/* views.js: the block grid (with its hover text), the request list and the contiguous view. */

const Grid = {
  element: null,
  cells: [],
  keys: [],      // what each cell shows now, so that a frame touches only the cells that changed
  holders: [],

  init(element, tooltip, onPick) {
    this.element = element;
    element.addEventListener("mouseover", (event) => {
      const block = Number(event.target.dataset.block);
      if (Number.isNaN(block)) return;
      tooltip.textContent = this.describe(block);
      tooltip.hidden = false;
      const cell = event.target, panel = element.parentElement.getBoundingClientRect();
      const box = cell.getBoundingClientRect();
      tooltip.style.left = `${Math.min(box.left - panel.left + 20, panel.width - 370)}px`;
      tooltip.style.top = `${box.top - panel.top + 20}px`;
    });
    element.addEventListener("mouseleave", () => { tooltip.hidden = true; });
    element.addEventListener("click", (event) => {
      const owners = event.target.dataset.owners;
      if (owners) onPick(owners.split(" ")[0]);
    });
  },

  build(count) {
    this.element.replaceChildren();
    this.cells = [];
    this.keys = [];
    for (let block = 0; block < count; block++) {
      const cell = document.createElement("div");
      cell.dataset.block = block;
      this.element.appendChild(cell);
      this.cells.push(cell);
      this.keys.push("");
    }
    this.element.dataset.blocks = count;
    this.fit(count);
  },

  /* Cells as large as the panel allows for this many blocks (6 to 30 px a side). */
  fit(count) {
    const width = this.element.clientWidth || 600, height = 360;
    const side = Math.max(6, Math.min(30, Math.floor(Math.sqrt((width * height) / count)) - 2));
    this.element.style.setProperty("--cell", `${side}px`);
    this.element.classList.toggle("tiny", side < 14);
  },

  render(selected) {
    if (this.cells.length !== Model.blocks.length) this.build(Model.blocks.length);
    this.holders = Model.holders();
    this.pages = Model.adapterPages();
    for (let block = 0; block < this.cells.length; block++) {
      const refcount = Model.refcount(block), cached = Model.isCached(block);
      const holders = this.holders[block] || [];
      const owners = [...new Set(holders.map((h) => h.seq.r))];
      const page = this.pages[block];
      const state = block === Model.config.nullBlock ? "null"
        : page ? (page.adapter.pins ? "adapter" : "adapter-idle")
        : refcount === 0 ? (cached ? "cached" : "free") : refcount > 1 ? "shared" : "used";
      // With KV groups a held block belongs to one group: full ones plain, sliding ones striped.
      const group = Model.hasGroups() && holders.length ? holders[0].group : "";
      const kind = group === "" ? "" : Model.config.kvGroups[group] === null ? " full" : " sliding";
      const key = `${state}|${refcount}|${owners.join(" ")}|${owners.includes(selected)}|${page ? page.name : ""}|${group}`;
      if (key === this.keys[block]) continue;
      this.keys[block] = key;
      const cell = this.cells[block];
      cell.className = `cell ${state}${kind}` + (owners.includes(selected) ? " selected" : "");
      cell.dataset.state = state;
      cell.dataset.refcount = refcount;
      cell.dataset.owners = owners.join(" ");
      cell.dataset.adapter = page ? page.name : "";
      cell.dataset.group = group;
      cell.style.backgroundColor = owners.length ? colourOf(owners[0]) : "";
      cell.textContent = state === "null" ? "∅" : refcount > 1 ? String(refcount) : "";
    }
  },

  describe(block) {
    if (block === Model.config.nullBlock) {
      return `block ${block}: the null block\nwhat a sliding group's table points at where its window has ` +
        "passed or a prompt chunk is still to come; never written, read as masked zeros";
    }
    const refcount = Model.refcount(block), cached = Model.isCached(block), page = this.pages[block];
    if (page) {
      const { name, adapter } = page;
      const use = adapter.pins
        ? `pinned by ${adapter.pins} running sequence${adapter.pins > 1 ? "s" : ""}`
        : "idle: taken back after the cached-free blocks, least recently used adapter first";
      return `block ${block}: LoRA adapter ${name}, page ${page.page + 1} of ${adapter.b.length}\n${use}`;
    }
    if (refcount === 0) {
      return cached
        ? `block ${block}: cached-free\nno request holds it; its tokens stay in the prefix cache until it is evicted`
        : `block ${block}: free`;
    }
    const lines = [`block ${block}: refcount ${refcount}${cached ? ", in the prefix cache" : ""}`];
    for (const { seq, logical, group } of this.holders[block] || []) {
      const [first, last] = Model.tokenRange(seq, logical);
      const where = Model.hasGroups() ? `${Model.groupLabel(group)} group, ` : "";
      lines.push(`${seq.r} #${seq.i}: ${where}logical block ${logical}, tokens ${first}–${last}`);
    }
    return lines.join("\n");
  },
};

const RequestList = {
  element: null,
  items: new Map(),  // request id -> its <li>, kept while the request lives (clicks stay on it)

  render(requests, selected, onPick) {
    for (const [id, item] of this.items) {
      if (!requests.has(id)) { item.remove(); this.items.delete(id); }
    }
    for (const [id, seqs] of requests) {
      let item = this.items.get(id);
      if (!item) {
        item = document.createElement("li");
        item.dataset.request = id;
        item.innerHTML = '<span class="swatch"></span><span class="id"></span><span class="meta"></span>';
        item.querySelector(".swatch").style.background = colourOf(id);
        item.querySelector(".id").textContent = id;
        item.addEventListener("click", () => onPick(id));
        this.element.appendChild(item);
        this.items.set(id, item);
      }
      item.className = id === selected ? "selected" : "";
      const blocks = new Set(seqs.flatMap((s) => s.b)).size;
      const tokens = Math.max(...seqs.map((s) => s.n));
      item.querySelector(".meta").textContent =
        `${seqs.length > 1 ? seqs.length + " seqs · " : ""}${tokens} tok · ${blocks} blk`;
    }
  },
};

/* With KV groups (a model with sliding-window layers): per group, what its tables hold now, the
   blocks its window handed back and the prompt chunks still to come. Hidden without groups. */
const GroupsView = {
  render() {
    const panel = document.getElementById("groups");
    panel.hidden = !Model.hasGroups();
    if (panel.hidden) return;
    const list = document.getElementById("group-list");
    const usage = Model.groupUsage();
    if (list.children.length !== usage.length) {
      list.replaceChildren(...usage.map((_, group) => {
        const item = document.createElement("li");
        item.dataset.group = group;
        item.dataset.window = Model.config.kvGroups[group] ?? "";
        item.innerHTML = `<i class="cell used ${Model.config.kvGroups[group] === null ? "full" : "sliding"}"></i><span></span>`;
        return item;
      }));
    }
    usage.forEach((u, group) => {
      const item = list.children[group];
      Object.assign(item.dataset, { held: u.held, expired: u.expired, pending: u.pending });
      const passed = Model.config.kvGroups[group] === null ? ""
        : ` · ${u.expired} handed back as the window passed` + (u.pending ? ` · ${u.pending} to come` : "");
      item.querySelector("span").textContent = `group ${group} (${Model.groupLabel(group)}): ${u.held} blocks held${passed}`;
    });
    document.getElementById("groups-summary").textContent =
      `${usage.length} groups, one pool · null block ${Model.config.nullBlock} (∅)`;
  },
};

/* What a contiguous allocator would do with the same sequences: every one reserves max_model_len
   token slots up front, samples and beams included (nothing is shared), in the same pool. */
const Contiguous = {
  render(element, text) {
    const { numBlocks, blockSize, maxModelLen } = Model.config;
    const capacity = numBlocks * blockSize;
    const seqs = [...Model.seqs.values()];
    const fit = Math.floor(capacity / maxModelLen);
    const shown = seqs.slice(0, fit);
    const regions = shown.map((seq, k) => {
      const region = document.createElement("div");
      region.className = "region";
      region.style.left = `${(100 * k * maxModelLen) / capacity}%`;
      region.style.width = `${(100 * maxModelLen) / capacity}%`;
      region.style.background = `repeating-linear-gradient(45deg, #fff 0 3px, #e5e5e0 3px 6px)`;
      const stored = document.createElement("div");
      stored.className = "stored";
      stored.style.width = `${(100 * Math.min(seq.n, maxModelLen)) / maxModelLen}%`;
      stored.style.background = colourOf(seq.r);
      region.appendChild(stored);
      return region;
    });
    if (seqs.length > fit) {
      const overflow = document.createElement("div");
      overflow.className = "overflow";
      regions.push(overflow);
    }
    element.replaceChildren(...regions);
    const tokens = seqs.reduce((sum, s) => sum + s.n, 0);
    const shownTokens = shown.reduce((sum, s) => sum + Math.min(s.n, maxModelLen), 0);
    const used = Model.stats.used;
    element.dataset.live = seqs.length;
    element.dataset.fit = Math.min(fit, seqs.length);
    text.textContent =
      `Paged: ${seqs.length} sequences hold ${used} of ${numBlocks} blocks (${used * blockSize} slots) ` +
      `for ${tokens} tokens. Contiguous: each reserves ${maxModelLen} slots, so at most ${fit} fit in ` +
      `the same ${capacity} slots; these ${seqs.length} would reserve ${seqs.length * maxModelLen} ` +
      `(${pct((seqs.length * maxModelLen) / capacity)} of the pool), ` +
      `${pct(shownTokens / Math.max(1, shown.length * maxModelLen), shown.length)} of what fits holding tokens` +
      (seqs.length > fit ? `, and ${seqs.length - fit} would wait.` : ".");
  },
};

function pct(fraction, nonEmpty = 1) {
  return nonEmpty ? `${Math.round(100 * Math.min(fraction, 99.99))} %` : "0 %";
}

/* The second KV tier beside the pool: its slots (cached prefix blocks, swapped-out requests'
   blocks, free), what its loads saved and what moved. Hidden without a tier. */
const TierView = {
  render(tier) {
    const panel = document.getElementById("tier");
    panel.hidden = !tier;
    if (!tier) return;
    const share = (n) => `${((100 * n) / tier.total).toFixed(2)}%`;
    const bar = document.getElementById("tier-bar");
    bar.querySelector(".cached").style.width = share(tier.cached);
    bar.querySelector(".swap").style.width = share(tier.swap);
    Object.assign(panel.dataset, { medium: tier.medium, cached: tier.cached, swap: tier.swap, hits: tier.hits });
    const mib = (bytes) => (bytes / 2 ** 20).toFixed(1);
    document.getElementById("tier-summary").textContent =
      `${tier.medium} · ${tier.total} blocks · ${tier.cached} cached, ${tier.swap} swapped out`;
    document.getElementById("tier-text").textContent =
      `${tier.hits} of ${tier.queries} prompt tokens loaded instead of computed · ` +
      `${tier.stored} blocks stored (${mib(tier.bytesOut)} MiB), ${tier.loaded} loaded (${mib(tier.bytesIn)} MiB)`;
  },
};
