// The console's router: `#/view/arg?k=v` → a view module's render(main, args, params).
// A view returns a cleanup function, called when the page moves on (streams, timers).
import { api, loadSession, session } from "./api.js";
import { toast } from "./dom.js";
import * as evals from "./views/evals.js";
import * as host from "./views/host.js";
import * as sandbox from "./views/sandbox.js";
import * as sandboxes from "./views/sandboxes.js";
import * as snapshots from "./views/snapshots.js";

const routes = [
  [/^\/sandboxes\/([\w.-]+)(?:\/(\w+))?$/, sandbox, "sandboxes"],
  [/^\/sandboxes$/, sandboxes, "sandboxes"],
  [/^\/snapshots$/, snapshots, "snapshots"],
  [/^\/evals(?:\/([\w.-]+))?$/, evals, "evals"],
  [/^\/host$/, host, "host"],
];

let cleanup = null;
let shown = 0; // which navigation is current: a view that finishes late is dropped

async function show() {
  const mine = ++shown;
  const [path, qs] = (location.hash.slice(1) || "/sandboxes").split("?");
  const params = new URLSearchParams(qs || "");
  const main = document.getElementById("main");
  if (cleanup) { cleanup(); cleanup = null; }
  main.replaceChildren();
  document.getElementById("toast").className = ""; // what the last page said is done
  for (const [pattern, view, nav] of routes) {
    const m = path.match(pattern);
    if (!m) continue;
    for (const a of document.querySelectorAll("nav a")) {
      if (a.dataset.nav === nav) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    }
    try {
      const done = (await view.render(main, m.slice(1), params)) || null;
      if (mine === shown) cleanup = done;
      else if (done) done(); // the page moved on meanwhile
    } catch (e) {
      if (mine === shown) toast(e.message, true);
    }
    return;
  }
  location.hash = "#/sandboxes";
}

async function start() {
  await loadSession();
  const who = document.getElementById("who");
  who.textContent = `${session.tenant}${session.admin ? " (admin)" : ""}${session.read_only ? " (read-only)" : ""}`;
  document.getElementById("logout").addEventListener("click", async () => {
    await api("POST", "/ui/logout");
    location.href = "/ui/login";
  });
  window.addEventListener("hashchange", show);
  await show();
}

start();
