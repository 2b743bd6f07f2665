// One sandbox: overview (limits, usage, labels, network, ports, who may use it), terminal,
// files, checkpoints, trace, lineage and (a desktop sandbox) its screen, as tabs; `#/sandboxes/ID/TAB?tenant=T`.
import { api } from "../api.js";
import { badge, h, mib, toast } from "../dom.js";
import { actionButtons, may } from "./actions.js";
import * as checkpoints from "./checkpoints.js";
import * as files from "./files.js";
import * as lineage from "./lineage.js";
import * as screen from "./screen.js";
import * as terminal from "./terminal.js";
import * as trace from "./trace.js";

const TABS = { overview: null, screen, terminal, files, checkpoints, trace, lineage };

export async function render(main, [id, tab], params) {
  tab = tab && tab in TABS ? tab : "overview";
  const tenant = params.get("tenant") || undefined;
  const suffix = tenant ? `?tenant=${encodeURIComponent(tenant)}` : "";
  const sb = await load(id, tenant);
  if (sb.state === "deleted" && !["trace", "lineage"].includes(tab)) tab = "trace";
  // the terminal runs commands (and a screenshot is one): only for a key that may exec in
  // it; the screen, for a sandbox of the desktop template
  const tabs = Object.keys(TABS).filter((t) =>
    (!["terminal", "screen"].includes(t) || may(sb, "exec")) && (t !== "screen" || sb.template === "desktop"));
  if (!tabs.includes(tab)) tab = "overview";
  const nav = h("nav", { class: "tabs", "aria-label": "Sandbox" }, tabs.map((t) =>
    h("a", { href: `#/sandboxes/${id}/${t}${suffix}`, "aria-current": t === tab ? "page" : false }, t)));
  const head = h("div", { class: "bar" },
    h("h1", {}, sb.name || sb.id), badge(sb.state), h("span", { class: "muted mono" }, sb.id),
    actionButtons(sb, async () => window.dispatchEvent(new HashChangeEvent("hashchange"))));
  const body = h("section", { id: "tab", "aria-label": tab });
  main.append(head, nav, body);
  if (tab === "overview") return overview(body, sb);
  return TABS[tab].render(body, sb);
}

// A deleted sandbox keeps its trace and its place in the lineage: shown from those.
async function load(id, tenant) {
  try {
    return await api("GET", `/v1/sandboxes/${id}`, { tenant });
  } catch (e) {
    if (e.status !== 404) throw e;
    await api("GET", `/v1/sandboxes/${id}/events?limit=1`, { tenant }); // 404 here too: unknown
    return { id, tenant, state: "deleted", labels: {} };
  }
}

function row(name, ...value) {
  return h("tr", {}, h("th", { scope: "row" }, name), h("td", {}, ...value));
}

async function overview(body, sb) {
  const usage = h("tbody");
  const rules = sb.network || {};
  body.append(
    h("div", { class: "cols" },
      h("table", { class: "kv" }, h("caption", {}, "Sandbox"), h("tbody", {},
        row("template", sb.template),
        row("tenant", sb.tenant || ""),
        row("creator", sb.creator || "made before keys had principals"),
        row("access", `${sb.visibility || "tenant"}${Object.keys(sb.shares || {}).length ? `; shared with ${Object.entries(sb.shares).map(([p, l]) => `${p} (${l})`).join(", ")}` : ""}`),
        row("your key", sb.permission || "–"),
        row("created", `${sb.created_at} (${sb.created_from || ""})`),
        row("limits", `${sb.vcpus} vCPU · ${sb.memory_mib} MiB · disk ${sb.disk_mib ? `${sb.disk_mib} MiB` : "template's"}`),
        row("wall clock", sb.ttl_seconds ? `${sb.ttl_seconds} s, then ${sb.ttl_action}` : "none"),
        row("idle", sb.idle_timeout_seconds ? `${sb.idle_timeout_seconds} s, then ${sb.idle_action}` : "none"),
        row("labels", Object.entries(sb.labels || {}).map(([k, v]) => h("span", { class: "label" }, `${k}=${v}`))),
        row("egress", `allow: ${(rules.allow || []).join(", ") || "nothing"}; deny: ${(rules.deny || []).join(", ") || "–"}`),
        row("secrets", Object.entries(sb.secrets || {}).map(([env, name]) => `${env} ← ${name}`).join(", ") || "none"),
        row("parent", sb.parent_id ? h("a", { href: `#/sandboxes/${sb.parent_id}${sb.tenant ? `?tenant=${encodeURIComponent(sb.tenant)}` : ""}` }, sb.parent_id) : "–"),
        row("accelerator", `${sb.accel || ""} ${sb.accel_reason ? `(${sb.accel_reason})` : ""}`),
        sb.error ? row("error", h("span", { class: "error" }, sb.error)) : null)),
      h("table", { class: "kv" }, h("caption", {}, "Usage"), usage)),
    may(sb, "exec") ? ports(sb) : null,
    may(sb, "manage") ? sharing(sb) : null);
  async function refresh() {
    try {
      const u = await api("GET", `/v1/sandboxes/${sb.id}/usage`, { tenant: sb.tenant });
      usage.replaceChildren(
        row("CPU time", u.cpu_seconds != null ? `${u.cpu_seconds.toFixed(2)} s` : "–"),
        row("guest memory", `${mib(u.guest_memory_used_mib)} of ${mib(u.guest_memory_total_mib)}`),
        row("guest disk", `${mib(u.guest_disk_used_mib)} of ${mib(u.guest_disk_total_mib)}`),
        row("host memory (PSS)", mib(u.host_memory_mib)),
        row("host disk", mib(u.disk_allocated_mib)),
        row("processes", u.pids ?? "–"),
        row("wall clock left", u.ttl_remaining_seconds != null ? `${Math.round(u.ttl_remaining_seconds)} s` : "–"));
    } catch (e) {
      usage.replaceChildren(row("usage", e.message));
    }
  }
  await refresh();
  const timer = setInterval(() => { if (!document.hidden) refresh(); }, 3000);
  return () => clearInterval(timer);
}

// A server listening in the sandbox, opened through a service URL in a new tab.
function ports(sb) {
  const port = h("input", { id: "port", type: "number", min: 1, max: 65535, value: 8000, "aria-label": "Port" });
  const out = h("span", { class: "muted" });
  const open = h("button", { type: "submit", disabled: sb.state !== "running" }, "Open port");
  const form = h("form", { class: "bar", "aria-label": "Ports" }, h("h2", {}, "Ports"),
    h("label", { for: "port" }, "A server in the sandbox on port"), port, open, out);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const win = window.open("about:blank", "_blank");
    try {
      const r = await api("POST", `/v1/sandboxes/${sb.id}/ports/${Number(port.value)}/expose`,
        { tenant: sb.tenant, json: { expires_in_seconds: 3600 } });
      out.textContent = `service URL valid until ${new Date(r.expires_at).toLocaleTimeString()}`;
      if (win) { win.opener = null; win.location = r.browser_url; }
    } catch (e) {
      if (win) win.close();
      toast(e.message, true);
    }
  });
  return form;
}


// Who may use the sandbox besides its creator and the tenant's owners (a key that manages
// it): its visibility and its shares, principal -> view, exec or manage, edited here and
// saved as a whole (PUT .../access); the page is drawn again from the answer.
const LEVEL_NAMES = ["view", "exec", "manage"];

function levelSelect(attrs, chosen) {
  return h("select", attrs, LEVEL_NAMES.map((l) => h("option", { value: l, selected: l === chosen }, l)));
}

function sharing(sb) {
  const shares = { ...(sb.shares || {}) };
  const visibility = h("select", { id: "visibility" }, ["private", "tenant"].map((v) =>
    h("option", { value: v, selected: (sb.visibility || "tenant") === v }, v)));
  const list = h("tbody");
  const principal = h("input", { id: "share-principal", autocomplete: "off", placeholder: "principal", "aria-label": "Principal to share with" });
  const level = levelSelect({ id: "share-level", "aria-label": "Permission to give" }, "view");
  function draw() {
    list.replaceChildren(...Object.entries(shares).map(([who, l]) =>
      h("tr", { dataset: { principal: who } },
        h("td", { class: "mono" }, who),
        h("td", {}, levelSelect({ "aria-label": `Permission of ${who}`, onchange: (ev) => { shares[who] = ev.target.value; } }, l)),
        h("td", {}, h("button", { type: "button", class: "small", "aria-label": `Unshare ${who}`,
          onclick: () => { delete shares[who]; draw(); } }, "unshare")))));
    if (!list.rows.length) list.append(h("tr", {}, h("td", { colspan: 3, class: "muted" }, "shared with no one")));
  }
  draw();
  const add = h("button", { type: "button", class: "small", onclick: () => {
    const name = principal.value.trim();
    if (!name) return;
    shares[name] = level.value;
    principal.value = "";
    draw();
  } }, "Add");
  const form = h("form", { id: "access", "aria-label": "Access" },
    h("h2", {}, "Access"),
    h("div", { class: "bar" }, h("label", { for: "visibility" }, "Visible to"), visibility,
      h("span", { class: "muted" }, "private: its creator, the tenant's owners and whom it is shared with; tenant: every key of the tenant may exec in it")),
    h("table", {}, h("caption", {}, "Shared with"),
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "principal"), h("th", { scope: "col" }, "may"), h("th", { scope: "col" }, ""))),
      list),
    h("div", { class: "bar" }, h("label", { for: "share-principal" }, "Share with"), principal, level, add,
      h("button", { type: "submit" }, "Save access")));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const pending = principal.value.trim();
    if (pending) { // typed but not added: meant all the same
      shares[pending] = level.value;
      principal.value = "";
      draw();
    }
    try {
      const r = await api("PUT", `/v1/sandboxes/${sb.id}/access`,
        { tenant: sb.tenant, json: { visibility: visibility.value, shares } });
      toast(r.permission ? `access saved: ${sb.id}` : `access saved: this key no longer sees ${sb.id}`);
      window.dispatchEvent(new HashChangeEvent("hashchange"));
    } catch (e) {
      toast(e.message, true);
    }
  });
  return form;
}
