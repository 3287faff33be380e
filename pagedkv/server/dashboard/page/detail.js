"use strict";
/* detail.js: one request -- its block tables drawn as logical -> physical arrows (one row per
   sample or beam, and with KV groups per group: a null entry drawn as ∅, without an arrow), its
   tokens, its prefix-cache hits and the blocks its forks share. */

const SVG = "http://www.w3.org/2000/svg";
const BOX = 24, GAP = 4, ROW = 40;

function svgElement(name, attributes, text) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

const Detail = {
  signature: null,

  render(element, requestId, seqs) {
    element.hidden = !requestId;
    if (!requestId) return;
    element.dataset.request = requestId;
    if (!seqs) {
      element.dataset.live = "false";
      element.innerHTML = "<h2></h2><p>Finished: its blocks went back to the pool.</p>";
      element.querySelector("h2").textContent = requestId;
      return;
    }
    // Redrawn only when the request changed: clicks and hovers stay on the same elements.
    const signature = JSON.stringify([requestId, seqs, seqs.map((s) => s.b.map((b) => Model.refcount(b)))]);
    if (signature === this.signature && element.dataset.live === "true") return;
    this.signature = signature;
    element.dataset.live = "true";
    const size = Model.config.blockSize;
    const physical = [...new Set(seqs.flatMap((s) => s.b))].sort((a, b) => a - b);
    const uses = new Map();
    for (const s of seqs) for (const block of s.b) uses.set(block, (uses.get(block) || 0) + 1);
    const forkShared = physical.filter((block) => uses.get(block) > 1).length;
    const othersShare = physical.filter((block) => Model.refcount(block) > uses.get(block)).length;
    const first = seqs[0];
    element.dataset.forkShared = forkShared;
    element.innerHTML = "<h2></h2><dl></dl>";
    element.querySelector("h2").textContent = requestId;
    const facts = [
      ["sequences", `${seqs.length}${seqs.length > 1 ? " (samples or beams, forked from one prompt)" : ""}`],
      ["prompt", `${first.p} tokens, ${first.c} from the prefix cache (${first.c / size} blocks)`],
      ["tokens so far", seqs.map((s) => `#${s.i}: ${s.n}`).join(", ")],
      ["physical blocks", `${physical.length}; ${forkShared} shared by its forks, ${othersShare} with other requests`],
    ];
    const list = element.querySelector("dl");
    for (const [term, value] of facts) {
      list.append(Object.assign(document.createElement("dt"), { textContent: term }));
      list.append(Object.assign(document.createElement("dd"), { textContent: value }));
    }
    const rows = seqs.flatMap((seq) => Model.tables(seq).map((table, group) => ({ seq, table, group })));
    element.appendChild(this.arrows(rows, physical, uses));
  },

  /* Rows of logical blocks (one per sequence and group) above one row of the physical blocks
     they map to. */
  arrows(rows, physical, uses) {
    const columns = Math.max(physical.length, ...rows.map((r) => r.table.length));
    const width = 56 + columns * (BOX + GAP), height = (rows.length + 1) * ROW + 30;
    const svg = svgElement("svg", { viewBox: `0 0 ${width} ${height}`, id: "block-table" });
    const marker = svgElement("marker", { id: "head", viewBox: "0 0 6 6", refX: 6, refY: 3,
      markerWidth: 6, markerHeight: 6, orient: "auto" });
    marker.appendChild(svgElement("path", { d: "M0,0 L6,3 L0,6 z", fill: "#6b7280" }));
    svg.appendChild(svgElement("defs", {})).appendChild(marker);
    const physicalY = rows.length * ROW + 20;
    const physicalX = new Map(physical.map((block, k) => [block, 56 + k * (BOX + GAP)]));
    const grouped = Model.hasGroups();
    rows.forEach(({ seq, table, group }, row) => {
      const y = row * ROW + 4;
      const label = grouped ? `#${seq.i} ${Model.config.kvGroups[group] === null ? "full" : "w" + Model.config.kvGroups[group]}` : `#${seq.i}`;
      svg.appendChild(svgElement("text", { x: 0, y: y + 15 }, label));
      table.forEach((block, logical) => {
        const x = 56 + logical * (BOX + GAP);
        const isNull = grouped && block === Model.config.nullBlock;
        svg.appendChild(svgElement("rect", { x, y, width: BOX, height: 20, rx: 2,
          fill: isNull ? "#e7e7e3" : colourOf(seq.r), "fill-opacity": isNull ? 1 : 0.35,
          stroke: isNull ? "#d8d8d4" : colourOf(seq.r), class: isNull ? "null" : "logical" }));
        svg.appendChild(svgElement("text", { x: x + 3, y: y + 14 }, isNull ? "∅" : `L${logical}`));
        if (isNull) return;
        const target = physicalX.get(block);
        svg.appendChild(svgElement("line", { class: "arrow", x1: x + BOX / 2, y1: y + 20,
          x2: target + BOX / 2, y2: physicalY - 2, stroke: "#6b7280", "marker-end": "url(#head)",
          "data-sample": seq.i, "data-group": group, "data-logical": logical, "data-physical": block }));
      });
    });
    svg.appendChild(svgElement("text", { x: 0, y: physicalY + 15 }, "phys"));
    for (const block of physical) {
      const shared = Model.refcount(block) > 1;
      const x = physicalX.get(block);
      svg.appendChild(svgElement("rect", { x, y: physicalY, width: BOX, height: 20, rx: 2, fill: "#fff",
        stroke: shared ? "#e0a100" : "#6b7280", "stroke-width": shared ? 2 : 1,
        class: "physical", "data-block": block, "data-shared": uses.get(block) > 1 }));
      svg.appendChild(svgElement("text", { x: x + 2, y: physicalY + 14 }, String(block)));
    }
    return svg;
  },
};
