"use strict";
/* stream.js: the server-sent events, read with fetch() so that the API key can travel in an
   Authorization header (EventSource cannot send one, and a key in the URL would reach logs).
   The stream reconnects whenever it ends -- a dropped slow page, a restarted server -- and every
   new connection starts with a full frame. */

const STREAM_URL = "/dashboard/stream";
const KEY_STORAGE = "pagedkv-dashboard-key";

const Stream = {
  key: sessionStorage.getItem(KEY_STORAGE),
  keyEntered: null,

  /* A key in the fragment (#key=...) is taken once and removed from the address bar. */
  takeKeyFromFragment() {
    const match = location.hash.match(/(?:^#|&)key=([^&]+)/);
    if (!match) return;
    this.setKey(decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname);
  },

  setKey(key) {
    this.key = key;
    sessionStorage.setItem(KEY_STORAGE, key);
    if (this.keyEntered) this.keyEntered();
  },

  waitForKey() { return new Promise((resolve) => { this.keyEntered = resolve; }); },

  async run(onFrame, onStatus, requiresKey) {
    let delay = 250;
    for (;;) {
      if (requiresKey && !this.key) {
        onStatus("login", "");
        await this.waitForKey();
      }
      try {
        const headers = this.key ? { Authorization: `Bearer ${this.key}` } : {};
        const response = await fetch(STREAM_URL, { headers, cache: "no-store" });
        if (response.status === 401) {
          onStatus("login", this.key ? "that key was refused" : "");
          this.key = null;
          sessionStorage.removeItem(KEY_STORAGE);
          await this.waitForKey();
          continue;
        }
        if (!response.ok) throw new Error(`HTTP ${response.status}`);
        onStatus("live", "live");
        delay = 250;
        await this.read(response.body, onFrame);
        onStatus("connecting", "the stream ended; reconnecting…");
      } catch (err) {
        onStatus("connecting", `server unreachable (${err.message}); retrying…`);
      }
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(2 * delay, 2000);
    }
  },

  async read(body, onFrame) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((line) => line.startsWith("data: "));
        if (data.length) onFrame(JSON.parse(data.map((line) => line.slice(6)).join("\n")));
      }
    }
  },
};
