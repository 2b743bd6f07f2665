// Snapshots: fork one into N branches, open the lineage of its source, delete it.
import { api, session } from "../api.js";
import { age, badge, bytes, confirmAction, h, replaceRows, toast } from "../dom.js";

export async function render(main, _args, params) {
  const body = h("tbody");
  main.append(h("div", { class: "bar" }, h("h1", {}, "Snapshots")),
    h("table", { class: "list", id: "snapshots" },
      h("thead", {}, h("tr", {}, ["Snapshot", "State", "Source", "Template", "Size", "Paused", "Age", "Actions"].map((c) => h("th", { scope: "col" }, c)))), body));
  const highlight = params.get("highlight");
  let drawn = "";

  async function refresh() {
    const all = session.admin ? "?all_tenants=true" : "";
    const data = await api("GET", `/v1/snapshots${all}`);
    const state = JSON.stringify(data.snapshots.map((sn) => [sn.id, sn.state]));
    if (state === drawn) return; // unchanged: what is typed in the table stays
    drawn = state;
    replaceRows(body, main, data.snapshots.filter((sn) => sn.state !== "deleted").map((sn) => {
      const count = h("input", { type: "number", min: 1, max: 64, value: 3, class: "count", "aria-label": `branches of ${sn.id}` });
      const tenant = session.admin && sn.tenant !== session.tenant ? sn.tenant : undefined;
      const suffix = tenant ? `?tenant=${encodeURIComponent(tenant)}` : "";
      return h("tr", { dataset: { id: sn.id }, class: sn.id === highlight ? "highlight" : "" },
        h("td", {}, sn.name, h("div", { class: "muted mono" }, sn.id)),
        h("td", {}, badge(sn.state)),
        h("td", {}, h("a", { href: `#/sandboxes/${sn.sandbox_id}/lineage${suffix}` }, sn.sandbox_id)),
        h("td", {}, sn.template),
        h("td", {}, bytes(sn.size_bytes)),
        h("td", {}, sn.paused_ms != null ? `${sn.paused_ms.toFixed(0)} ms` : ""),
        h("td", {}, age(sn.created_at)),
        h("td", {}, sn.state === "ready" ? h("span", { class: "actions" }, count,
          h("button", { type: "button", class: "small", dataset: { action: "fork" }, onclick: async () => {
            const n = Number(count.value);
            if (!(await confirmAction(`fork ${sn.name} into ${n} sandboxes?`))) return;
            try {
              const r = await api("POST", `/v1/snapshots/${sn.id}/fork`, { tenant, json: { count: n } });
              toast(`${r.sandboxes.length} branches: ${r.sandboxes.map((b) => b.id).join(", ")}`);
            } catch (e) { toast(e.message, true); }
          } }, "fork"),
          h("button", { type: "button", class: "small danger", dataset: { action: "delete" }, onclick: async () => {
            if (!(await confirmAction(`delete snapshot ${sn.name} (${sn.id})?`))) return;
            try { await api("DELETE", `/v1/snapshots/${sn.id}`, { tenant }); await refresh(); } catch (e) { toast(e.message, true); }
          } }, "delete")) : null));
    }));
  }
  await refresh();
  const marked = highlight && body.querySelector(`tr[data-id="${CSS.escape(highlight)}"]`);
  if (marked) { // arrived from a lineage node: that snapshot, in view and focused
    marked.tabIndex = -1;
    marked.scrollIntoView({ block: "center" });
    marked.focus();
  }
  const timer = setInterval(() => { if (!document.hidden) refresh().catch(() => {}); }, 3000);
  return () => clearInterval(timer);
}
