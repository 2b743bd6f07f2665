// The host (or the fleet behind a gateway): capacity committed and free, pool fill,
// accelerator, egress proxy.
import { api, session } from "../api.js";
import { h } from "../dom.js";

function meter(label, used, total, unit) {
  const pct = total ? Math.round((100 * used) / total) : 0;
  return h("div", { class: "meter" }, h("label", {}, `${label}: ${used} of ${total} ${unit} committed (${total - used} free)`),
    h("progress", { max: total || 1, value: used, "aria-label": label }, `${pct}%`));
}

export async function render(main) {
  const health = await api("GET", "/v1/health");
  const pool = Object.entries(health.pool || {});
  main.append(h("h1", {}, "Host"),
    h("table", { class: "kv", id: "health" }, h("tbody", {},
      h("tr", {}, h("th", { scope: "row" }, "accelerator"), h("td", {}, `${health.accel || "–"} ${health.accel_reason ? `(${health.accel_reason})` : ""}`)),
      h("tr", {}, h("th", { scope: "row" }, "egress proxy"), h("td", {}, health.proxy ? (health.proxy.running ? `running on 127.0.0.1:${health.proxy.port}` : "NOT RUNNING") : "–")),
      h("tr", {}, h("th", { scope: "row" }, "warm pool"), h("td", {}, pool.length ? pool.map(([shape, n]) => h("div", {}, `${shape}: ${n} of ${health.pool_size} ready`)) : `empty (size ${health.pool_size})`)))));
  if (!session.admin) {
    main.append(h("p", { class: "muted" }, "Capacity is shown to admin keys."));
    return null;
  }
  const cap = await api("GET", "/v1/capacity");
  main.append(h("section", { id: "capacity", "aria-label": "Capacity" }, h("h2", {}, "Capacity"),
    meter("memory", cap.memory_mib_committed, cap.memory_mib, "MiB"),
    meter("vCPUs", cap.vcpus_committed, cap.vcpus, ""),
    h("p", {}, `${cap.live_sandboxes} live sandboxes`)));
  try {
    const fleet = await api("GET", "/v1/fleet");
    main.append(h("section", { id: "fleet" }, h("h2", {}, "Fleet"), h("table", { class: "list" },
      h("thead", {}, h("tr", {}, ["Node", "Health", "Memory", "vCPUs", "Sandboxes", "Warm pool", "Egress proxy", "Snapshots"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, (fleet.nodes || []).map((n) => h("tr", {},
        h("td", {}, n.name), h("td", {}, n.healthy ? "healthy" : `down: ${n.reason || ""}`),
        h("td", {}, n.capacity ? `${n.capacity.memory_mib_committed} / ${n.capacity.memory_mib} MiB` : "–"),
        h("td", {}, n.capacity ? `${n.capacity.vcpus_committed} / ${n.capacity.vcpus}` : "–"),
        h("td", {}, String(n.sandboxes ?? "–")),
        h("td", {}, Object.entries(n.pool || {}).map(([shape, count]) => `${shape}: ${count}`).join(", ") || "–"),
        h("td", {}, n.proxy_running == null ? "–" : n.proxy_running ? "running" : "NOT RUNNING"),
        h("td", {}, String((n.snapshots || []).length))))))));
  } catch (_) { /* a single host: no fleet */ }
  return null;
}
