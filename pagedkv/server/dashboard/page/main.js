"use strict";
/* main.js: wires the stream to the views. The page's state is in data- attributes too
   (connection, frames, boot id, each cell's state and owners): what the browser tests read. */

const Page = {
  selected: null,
  boot: null,

  start() {
    const $ = (id) => document.getElementById(id);
    this.status = $("status");
    this.statusText = $("status-text");
    RequestList.element = $("requests");
    Grid.init($("grid"), $("tooltip"), (id) => this.pick(id));
    Charts.init($("charts"));
    $("login").addEventListener("submit", (event) => {
      event.preventDefault();
      $("login").hidden = true;
      Stream.setKey($("api-key").value);
    });
    Stream.takeKeyFromFragment();
    Stream.run((frame) => this.onFrame(frame), (state, text) => this.onStatus(state, text),
      document.body.dataset.requiresKey === "true");
  },

  onStatus(state, text) {
    this.status.dataset.connection = state;
    const login = document.getElementById("login");
    login.hidden = state !== "login";
    document.getElementById("dashboard").hidden = state === "login";
    if (state === "login") {
      this.statusText.textContent = "API key required";
      document.getElementById("login-error").textContent = text;
      document.getElementById("api-key").focus();
    } else {
      this.statusText.textContent = text;
    }
  },

  onFrame(frame) {
    if (frame.kind === "full" && frame.config.boot !== this.boot) {
      this.boot = frame.config.boot;
      Charts.reset();  // a restarted server: its counters start again
      this.status.dataset.boot = this.boot;
    }
    Model.apply(frame);
    this.status.dataset.frames = Model.frames;
    this.render();
    Charts.add(Model.stats, Model.config);
  },

  pick(requestId) {
    this.selected = requestId;
    this.render();
  },

  render() {
    const requests = Model.requests();
    const { numBlocks, blockSize, model } = Model.config;
    const stats = Model.stats;
    document.getElementById("pool-summary").textContent =
      `${model} · ${numBlocks} blocks of ${blockSize} tokens · ${stats.used} in use, ` +
      `${stats.cachedFree} cached-free` + (stats.adapterPages ? `, ${stats.adapterPages} LoRA adapter pages` : "") +
      ` · step ${stats.step}` + speculation(stats);
    document.getElementById("request-summary").textContent =
      `${stats.running} running, ${stats.waiting} waiting (click one, or a cell)`;
    TierView.render(stats.tier);
    Grid.render(this.selected);
    GroupsView.render();
    RequestList.render(requests, this.selected, (id) => this.pick(id));
    Detail.render(document.getElementById("detail"), this.selected, requests.get(this.selected));
    Contiguous.render(document.getElementById("contiguous"), document.getElementById("contiguous-text"));
  },
};

/* A speculating engine's acceptance rate and mean acceptance length, as vLLM logs them. */
function speculation(stats) {
  if (stats.specDrafts === undefined) return "";
  if (!stats.specDrafts) return " · speculation: no draft yet";
  const rate = (100 * stats.specAccepted) / stats.specDraftTokens;
  const length = 1 + stats.specAccepted / stats.specDrafts;
  return ` · speculation: ${rate.toFixed(1)} % accepted, ${length.toFixed(2)} tokens per draft`;
}

Page.start();
