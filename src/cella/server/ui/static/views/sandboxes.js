// The live list of sandboxes: state, template, limits, usage, labels, age; filter,
// search and actions.
import { api, query, session } from "../api.js";
import { age, badge, h, mib, replaceRows, toast } from "../dom.js";
import { actionButtons } from "./actions.js";

const POLL_MS = 500;
const USAGE_MS = 5000;
const STATES = ["", "running", "paused", "stopped", "error", "lost", "deleted"];

export function sandboxLink(sb) {
  const tenant = session.admin && sb.tenant !== session.tenant ? `?tenant=${encodeURIComponent(sb.tenant)}` : "";
  return `#/sandboxes/${sb.id}${tenant}`;
}

export async function render(main) {
  const search = h("input", { id: "search", type: "search", placeholder: "id, name, template, label…", "aria-label": "Search sandboxes" });
  const state = h("select", { id: "state-filter", "aria-label": "State" },
    STATES.map((st) => h("option", { value: st }, st || "any live state")));
  const body = h("tbody");
  const count = h("span", { class: "muted", "aria-live": "polite" });
  const table = h("table", { id: "sandboxes", class: "list" },
    h("caption", { class: "visually-hidden" }, "Sandboxes"),
    h("thead", {}, h("tr", {}, ["Sandbox", "State", "Template", "Limits", "CPU", "Memory", "Disk", "Labels", "Age", "Actions"].map((c) => h("th", { scope: "col" }, c)))),
    body);
  const create = h("button", { type: "button", onclick: () => newSandbox() }, "New sandbox");
  main.append(h("div", { class: "bar" }, h("h1", {}, "Sandboxes"), count, search, state, create), table);

  const usage = new Map();
  let rows = [];
  let stopped = false;
  let drawn = ""; // what the table shows: redrawn only when that changes (focus stays put)
  let busy = false;

  function matches(sb) {
    const q = search.value.trim().toLowerCase();
    if (!q) return true;
    const text = [sb.id, sb.name, sb.template, sb.tenant, ...Object.entries(sb.labels || {}).map(([k, v]) => `${k}=${v}`)].join(" ").toLowerCase();
    return text.includes(q);
  }

  function draw() {
    const shown = rows.filter(matches);
    const view = JSON.stringify([search.value, shown, shown.map((sb) => usage.get(sb.id) || null)]);
    if (view === drawn) {
      for (const cell of body.querySelectorAll("td[data-created]")) cell.textContent = age(cell.dataset.created);
      return;
    }
    drawn = view;
    count.textContent = `${shown.length} of ${rows.length}`;
    replaceRows(body, search, shown.map((sb) => {
      const u = usage.get(sb.id) || {};
      return h("tr", { dataset: { id: sb.id, state: sb.state } },
        h("td", {}, h("a", { href: sandboxLink(sb) }, sb.name || sb.id), sb.name ? h("div", { class: "muted mono" }, sb.id) : null,
          session.admin ? h("div", { class: "muted" }, sb.tenant) : null),
        h("td", {}, badge(sb.state)),
        h("td", {}, sb.template),
        h("td", {}, `${sb.vcpus} vCPU · ${sb.memory_mib} MiB${sb.disk_mib ? ` · ${sb.disk_mib} MiB disk` : ""}`),
        h("td", {}, u.cpu_seconds != null ? `${u.cpu_seconds.toFixed(1)} s` : "–"),
        h("td", {}, u.guest_memory_used_mib != null ? `${mib(u.guest_memory_used_mib)} / ${mib(u.guest_memory_total_mib)}` : "–"),
        h("td", {}, u.guest_disk_used_mib != null ? `${mib(u.guest_disk_used_mib)} / ${mib(u.guest_disk_total_mib)}` : "–"),
        h("td", {}, Object.entries(sb.labels || {}).map(([k, v]) => h("span", { class: "label" }, `${k}=${v}`))),
        h("td", { title: sb.created_at, dataset: { created: sb.created_at } }, age(sb.created_at)),
        h("td", {}, actionButtons(sb, refresh)));
    }));
  }

  async function refresh() {
    if (busy) return; // a slow answer is not overtaken by the next poll
    busy = true;
    try {
      const all = session.admin ? { all_tenants: true } : {};
      const data = await api("GET", `/v1/sandboxes${query({ ...all, state: state.value || undefined })}`);
      rows = data.sandboxes.filter((sb) => state.value || sb.state !== "deleted");
      draw();
    } catch (e) {
      toast(e.message, true);
    } finally {
      busy = false;
    }
  }

  async function refreshUsage() {
    const live = rows.filter((sb) => sb.state === "running").slice(0, 50);
    await Promise.all(live.map(async (sb) => {
      try {
        usage.set(sb.id, await api("GET", `/v1/sandboxes/${sb.id}/usage`, { tenant: sb.tenant }));
      } catch (_) { /* gone meanwhile */ }
    }));
    draw();
  }

  async function newSandbox() {
    try {
      const sb = await api("POST", "/v1/sandboxes", { json: {} });
      toast(`created ${sb.id}`);
      await refresh();
    } catch (e) {
      toast(e.message, true);
    }
  }

  search.addEventListener("input", draw);
  state.addEventListener("change", refresh);
  await refresh();
  refreshUsage();
  const poll = setInterval(() => { if (!stopped && !document.hidden) refresh(); }, POLL_MS);
  const usagePoll = setInterval(() => { if (!stopped && !document.hidden) refreshUsage(); }, USAGE_MS);
  return () => { stopped = true; clearInterval(poll); clearInterval(usagePoll); };
}
