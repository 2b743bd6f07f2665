// A sandbox's checkpoints: take one, see what changed since one (to the next, or to now),
// rewind the sandbox to one. Diffs are shown as text only: file names and contents are
// the sandbox's.
import { api } from "../api.js";
import { age, bytes, confirmAction, h, toast } from "../dom.js";
import { may } from "./actions.js";

const SIGN = { added: "+", removed: "-", modified: "~" };

function changeList(diff) {
  if (!diff.changes.length) return h("p", { class: "muted" }, "No file changed.");
  return h("ul", { class: "changes", id: "diff" }, diff.changes.map((c) => {
    const size = c.size ?? c.old_size;
    const note = c.binary ? " (binary)" : c.too_large ? " (too large to diff)" : "";
    const item = h("li", { class: c.change, dataset: { path: c.path, change: c.change } },
      h("span", { class: "mono" }, `${SIGN[c.change]} ${c.path}`),
      h("span", { class: "muted" }, ` ${c.kind} ${bytes(size)}${note}`));
    // a short list shows its diffs open
    if (c.diff) item.append(h("details", { open: diff.changes.length <= 5 }, h("summary", {}, "diff"), h("pre", { class: "mono" }, c.diff)));
    return item;
  }));
}

export async function render(body, sb) {
  const tenant = sb.tenant;
  const list = h("tbody");
  const out = h("div", { id: "checkpoint-diff" });
  const canExec = may(sb, "exec") && sb.state === "running";
  const canManage = may(sb, "manage") && sb.state === "running";
  const name = h("input", { type: "text", placeholder: "name (optional)", "aria-label": "checkpoint name" });
  const take = h("button", { type: "button", dataset: { action: "checkpoint" }, disabled: !canExec, onclick: async () => {
    try {
      const cp = await api("POST", `/v1/sandboxes/${sb.id}/checkpoints`, { tenant, json: name.value ? { name: name.value } : {} });
      toast(`checkpoint ${cp.name} taken (${cp.paused_ms} ms paused)`);
      name.value = "";
      await refresh();
    } catch (e) { toast(e.message, true); }
  } }, "take checkpoint");

  async function showDiff(a, b) {
    out.replaceChildren(h("p", { class: "muted" }, `comparing ${a} with ${b}…`));
    try {
      const diff = await api("GET", `/v1/sandboxes/${sb.id}/diff?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`, { tenant });
      out.replaceChildren(h("h2", {}, `${a} → ${b}`), changeList(diff));
      if (diff.truncated) out.append(h("p", { class: "muted" }, "More paths changed than are listed."));
    } catch (e) { out.replaceChildren(); toast(e.message, true); }
  }

  async function refresh() {
    const data = await api("GET", `/v1/sandboxes/${sb.id}/checkpoints`, { tenant });
    const cps = data.checkpoints;
    list.replaceChildren(...cps.map((cp, i) => {
      const next = i + 1 < cps.length ? cps[i + 1].name : "now";
      return h("tr", { dataset: { id: cp.id, name: cp.name } },
        h("td", {}, cp.name, h("div", { class: "muted mono" }, cp.id)),
        h("td", {}, age(cp.created_at)),
        h("td", {}, cp.paused_ms != null ? `${cp.paused_ms.toFixed(0)} ms` : ""),
        h("td", {}, h("span", { class: "actions" },
          h("button", { type: "button", class: "small", dataset: { action: "diff" }, onclick: () => showDiff(cp.name, next) }, `diff → ${next}`),
          next !== "now" ? h("button", { type: "button", class: "small", dataset: { action: "diff-now" }, onclick: () => showDiff(cp.name, "now") }, "diff → now") : null,
          h("button", { type: "button", class: "small danger", dataset: { action: "rewind" }, disabled: !canManage, onclick: async () => {
            if (!(await confirmAction(`rewind ${sb.name || sb.id} to ${cp.name}? What ran since is lost (later checkpoints are kept).`))) return;
            try {
              await api("POST", `/v1/sandboxes/${sb.id}/rewind`, { tenant, json: { checkpoint: cp.name } });
              toast(`rewound to ${cp.name}`);
            } catch (e) { toast(e.message, true); }
          } }, "rewind"))));
    }));
  }
  body.append(h("div", { class: "bar" }, name, take),
    h("table", { class: "list", id: "checkpoints" },
      h("thead", {}, h("tr", {}, ["Checkpoint", "Age", "Paused", "Actions"].map((c) => h("th", { scope: "col" }, c)))), list),
    out);
  await refresh();
  return null;
}
