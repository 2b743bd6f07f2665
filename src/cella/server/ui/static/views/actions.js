// Lifecycle actions on a sandbox, each confirmed first; only those the key may take.
import { api } from "../api.js";
import { confirmAction, h, toast } from "../dom.js";

const ACTIONS = {
  running: ["pause", "stop", "snapshot", "fork", "delete"],
  paused: ["resume", "stop", "delete"],
  stopped: ["resume", "delete"],
  error: ["delete"],
  lost: ["delete"],
};

// What each action needs of the caller (the sandbox's `permission` says what it has): a
// control the key may not use is not shown.
const NEEDS = { pause: "manage", stop: "manage", delete: "manage", resume: "exec", snapshot: "exec", fork: "exec" };
const LEVELS = { view: 1, exec: 2, manage: 3 };

export function may(sb, level) {
  return (LEVELS[sb.permission] || 0) >= LEVELS[level];
}

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
  const allowed = (ACTIONS[sb.state] || []).filter((action) => may(sb, NEEDS[action]));
  return h("span", { class: "actions" }, allowed.map((action) =>
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
