"use strict";
/* model.js: the engine's state as the stream describes it. A block is one integer,
   refcount * 2 + cached; a sequence is {r: request id, i: sample/beam index, b: block table,
   n: tokens, p: prompt tokens, c: prompt tokens served by the prefix cache, g: with KV groups,
   each group's table, the null block where a window passed or a prompt chunk is to come}; a
   resident LoRA adapter (unified paging) is {id, b: its pages, pins: running sequences using it},
   by name. A full frame replaces everything, a diff patches blocks, sequences and adapters (see
   pagedkv/server/dashboard/frames.py). */

const Model = {
  config: null,
  blocks: [],
  seqs: new Map(),
  adapters: new Map(),
  stats: null,
  frames: 0,

  apply(frame) {
    if (frame.kind === "full") {
      this.config = frame.config;
      this.blocks = frame.blocks.slice();
      this.seqs = new Map(Object.entries(frame.seqs));
      this.adapters = new Map(Object.entries(frame.adapters || {}));
    } else {
      const changed = frame.blocks;
      for (let k = 0; k < changed.length; k += 2) this.blocks[changed[k]] = changed[k + 1];
      for (const [key, fields] of Object.entries(frame.seqs)) {
        const seq = this.seqs.get(key);
        this.seqs.set(key, seq ? Object.assign(seq, fields) : fields);
      }
      for (const key of frame.gone) this.seqs.delete(key);
      for (const [name, adapter] of Object.entries(frame.adapters || {})) this.adapters.set(name, adapter);
      for (const name of frame.adaptersGone || []) this.adapters.delete(name);
    }
    this.stats = frame.stats;
    this.frames += 1;
  },

  refcount(block) { return this.blocks[block] >> 1; },
  isCached(block) { return (this.blocks[block] & 1) === 1; },

  /* Per physical block, the {seq, logical, group} entries of the tables that point at it (the
     null block left out: every sliding table points at it, none holds it). */
  holders() {
    const holders = new Array(this.blocks.length);
    for (const seq of this.seqs.values()) {
      this.tables(seq).forEach((table, group) => {
        table.forEach((block, logical) => {
          if (block !== this.config.nullBlock) (holders[block] ||= []).push({ seq, logical, group });
        });
      });
    }
    return holders;
  },

  /* A sequence's tables: one per KV group, or its one table (group 0) without groups. */
  tables(seq) { return seq.g && seq.g.length ? seq.g : [seq.b]; },

  hasGroups() { return (this.config.kvGroups || []).length > 0; },

  /* "full" or "window N": what the layers of KV group `group` attend over. */
  groupLabel(group) {
    const window = this.config.kvGroups[group];
    return window === null ? "full" : `window ${window}`;
  },

  /* Per KV group: blocks its tables hold, entries whose blocks went back as the window passed
     (leading null entries) and entries whose prompt chunk is still to come (trailing ones). */
  groupUsage() {
    const usage = this.config.kvGroups.map(() => ({ held: new Set(), expired: 0, pending: 0 }));
    const nullBlock = this.config.nullBlock;
    for (const seq of this.seqs.values()) {
      (seq.g || []).forEach((table, group) => {
        const live = table.filter((block) => block !== nullBlock);
        live.forEach((block) => usage[group].held.add(block));
        const first = table.findIndex((block) => block !== nullBlock);
        const last = table.length - 1 - [...table].reverse().findIndex((block) => block !== nullBlock);
        usage[group].expired += first < 0 ? 0 : first;
        usage[group].pending += first < 0 ? 0 : table.length - 1 - last;
      });
    }
    return usage.map((u) => ({ held: u.held.size, expired: u.expired, pending: u.pending }));
  },

  /* Per physical block, the {name, adapter, page} of the resident adapter whose page it is. */
  adapterPages() {
    const pages = new Array(this.blocks.length);
    for (const [name, adapter] of this.adapters) {
      adapter.b.forEach((block, page) => { pages[block] = { name, adapter, page }; });
    }
    return pages;
  },

  /* Request id -> its live sequences, by index. */
  requests() {
    const requests = new Map();
    for (const seq of this.seqs.values()) {
      if (!requests.has(seq.r)) requests.set(seq.r, []);
      requests.get(seq.r).push(seq);
    }
    for (const seqs of requests.values()) seqs.sort((a, b) => a.i - b.i);
    return requests;
  },

  /* The tokens logical block `logical` of `seq` holds, as [first, last] (inclusive). */
  tokenRange(seq, logical) {
    const size = this.config.blockSize;
    return [logical * size, Math.min((logical + 1) * size, seq.n) - 1];
  },
};

/* A stable colour per request id (a hash to a hue). */
function colourOf(requestId) {
  let hash = 2166136261;
  for (let k = 0; k < requestId.length; k++) hash = Math.imul(hash ^ requestId.charCodeAt(k), 16777619);
  return `hsl(${(hash >>> 0) % 360} 62% 52%)`;
}

function shortId(requestId) {
  return requestId.length > 18 ? requestId.slice(0, 9) + "…" + requestId.slice(-6) : requestId;
}
