// The KV cache as a grid of cells, one per block (or, for pools larger than `maxCells`, one per run of blocks,
// showing the busiest state among them). Cells are updated in place, only where they changed, so a pool of
// thousands of blocks redraws cheaply a few times a second.

import { el } from "./api.js";

const STATES = { ".": "free", c: "cached", u: "used", s: "shared" };
const RANK = { free: 0, cached: 1, used: 2, shared: 3 }; // which state an aggregated cell shows

/** A stable colour per user request (its n sequences and beams share it): golden-angle hues. */
export function requestHue(groupId) {
  let hash = 2166136261;
  for (let i = 0; i < groupId.length; i++) hash = Math.imul(hash ^ groupId.charCodeAt(i), 16777619);
  return Math.round(((hash >>> 0) * 137.508) % 360);
}

export class BlockGrid {
  constructor(container, maxCells) {
    this.container = container;
    this.maxCells = maxCells;
    this.cells = [];
    this.blocksPerCell = 1;
  }

  /** pool: {num_blocks, states}; owners: Map block id -> group id of a request holding it. */
  update(pool, owners) {
    this.resize(pool.num_blocks);
    const per = this.blocksPerCell;
    for (let c = 0; c < this.cells.length; c++) {
      let state = "free";
      let owner = null;
      for (let block = c * per; block < Math.min((c + 1) * per, pool.num_blocks); block++) {
        const blockState = STATES[pool.states[block]] ?? "free"; // past the string: never used, free
        if (RANK[blockState] > RANK[state]) state = blockState;
        owner ??= owners.get(block) ?? null;
      }
      this.paint(this.cells[c], c, state, owner);
    }
  }

  resize(numBlocks) {
    const per = Math.max(1, Math.ceil(numBlocks / this.maxCells));
    const count = Math.ceil(numBlocks / per);
    if (count === this.cells.length && per === this.blocksPerCell) return;
    this.blocksPerCell = per;
    this.cells = Array.from({ length: count }, () => el("i", "cell free"));
    this.container.replaceChildren(...this.cells);
    this.container.dataset.blocksPerCell = per;
  }

  paint(cell, index, state, owner) {
    const key = `${state}|${owner}`;
    if (cell.dataset.key === key) return;
    cell.dataset.key = key;
    cell.className = `cell ${state}`;
    if (owner !== null && (state === "used" || state === "shared")) {
      cell.style.setProperty("--hue", requestHue(owner));
    } else {
      cell.style.removeProperty("--hue");
    }
    const first = index * this.blocksPerCell;
    const range = this.blocksPerCell > 1 ? `blocks ${first}-${first + this.blocksPerCell - 1}` : `block ${first}`;
    cell.title = `${range}: ${state}${owner !== null ? ` · ${owner}` : ""}`;
  }
}

/** Block id -> group id, from the requests' block tables (device) or swapped-out blocks (host). */
export function blockOwners(requests, field) {
  const owners = new Map();
  for (const request of requests) {
    for (const block of request[field]) if (!owners.has(block)) owners.set(block, request.group_id);
  }
  return owners;
}
