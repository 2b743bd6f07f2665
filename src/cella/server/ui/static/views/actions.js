// Lifecycle actions on a sandbox, each confirmed first.
import { api } from "../api.js";
import { confirmAction, h, toast } from "../dom.js";

const ACTIONS = {
  running: ["pause", "stop", "snapshot", "fork", "delete"],
  paused: ["resume", "stop", "delete"],
  stopped: ["resume", "delete"],
  error: ["delete"],
  lost: ["delete"],
};

async function act(sb, action) {
  const what = action === "fork" ? "fork (1 branch)" : action;
  if (!(await confirmAction(`${what} sandbox ${sb.name || sb.id}?`))) return false;
  const base = `/v1/sandboxes/${sb.id}`;
  const opts = { tenant: sb.tenant };
  if (action === "delete") await api("DELETE", base, opts);
  else if (action === "snapshot") await api("POST", `${base}/snapshots`, { ...opts, json: { name: "console" } });
  else if (action === "fork") await api("POST", `${base}/fork`, { ...opts, json: { count: 1 } });
  else await api("POST", `${base}/${action}`, opts);
  toast(`${action}: ${sb.id}`);
  return true;
}

export function actionButtons(sb, after) {
  return h("span", { class: "actions" }, (ACTIONS[sb.state] || []).map((action) =>
    h("button", {
      type: "button",
      class: action === "delete" ? "danger small" : "small",
      "aria-label": `${action} ${sb.id}`,
      dataset: { action },
      onclick: async () => {
        try {
          if (await act(sb, action)) await after();
        } catch (e) {
          toast(e.message, true);
        }
      },
    }, action)));
}
