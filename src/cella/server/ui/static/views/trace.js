// The sandbox's trace as a timeline that follows new events as they happen.
import { download, lines, query } from "../api.js";
import { badge, bytes, h, time } from "../dom.js";

const GROUPS = {
  exec: ["exec"],
  files: ["file_write", "file_remove", "file_move", "mkdir", "chmod", "chown"],
  egress: ["egress"],
  limits: ["limit_hit"],
  lifecycle: null, // everything else
};

function group(type) {
  for (const [name, types] of Object.entries(GROUPS)) if (types && types.includes(type)) return name;
  return "lifecycle";
}

function command(c) {
  return Array.isArray(c) ? c.join(" ") : String(c ?? "");
}

function detail(ev) {
  const d = ev.data || {};
  switch (ev.type) {
    case "exec": {
      const ok = d.exit_code === 0;
      return [
        h("code", { class: "cmd" }, command(d.command)),
        " ", badge(d.timed_out ? "timed out" : `exit ${d.exit_code}`, ok ? "ok" : "bad"),
        " ", h("span", { class: "muted" }, `${d.duration_ms} ms · ${bytes(d.stdout_bytes)} out · ${bytes(d.stderr_bytes)} err`),
        d.output_tail ? h("details", {}, h("summary", {}, "output tail"), h("pre", {}, d.output_tail)) : null,
      ];
    }
    case "file_write":
      return [h("code", {}, d.path), " ", h("span", { class: "muted" }, `${bytes(d.size)} · sha256 ${String(d.sha256 || "").slice(0, 16)}…`)];
    case "egress": {
      const allowed = d.allowed ?? d.action === "allow";
      return [badge(allowed ? "allowed" : "denied", allowed ? "ok" : "bad"), " ",
        h("code", {}, `${d.method ? `${d.method} ` : ""}${d.host ?? ""}${d.port ? `:${d.port}` : ""}${d.path ?? ""}`),
        " ", h("span", { class: "muted" }, d.reason || "")];
    }
    case "limit_hit":
      return [badge("limit", "bad"), " ", h("span", {}, d.limit || d.what || ""), " ", h("span", { class: "muted" }, d.message || JSON.stringify(d))];
    default:
      return [h("span", { class: "muted" }, Object.keys(d).length ? JSON.stringify(d) : "")];
  }
}

export async function render(body, sb) {
  const shown = new Set(Object.keys(GROUPS));
  const filters = h("fieldset", { class: "bar" }, h("legend", {}, "Show"), Object.keys(GROUPS).map((g) =>
    h("label", {}, h("input", { type: "checkbox", checked: true, dataset: { group: g }, onchange: (e) => {
      if (e.target.checked) shown.add(g); else shown.delete(g);
      for (const li of timeline.children) li.hidden = !shown.has(li.dataset.group);
    } }), ` ${g}`)));
  const exportButton = h("button", { type: "button", onclick: () => download(`/v1/sandboxes/${sb.id}/events/stream`, `${sb.id}.trace.jsonl`, sb.tenant) }, "Export JSON Lines");
  const status = h("span", { class: "muted", "aria-live": "polite" }, "loading…");
  const timeline = h("ol", { id: "timeline", class: "timeline", "aria-label": "Trace" });
  body.append(h("div", { class: "bar" }, filters, exportButton, status), timeline);

  function add(ev) {
    const g = group(ev.type);
    timeline.append(h("li", { dataset: { group: g, type: ev.type, id: ev.id }, hidden: !shown.has(g) },
      h("time", { datetime: ev.at }, time(ev.at)), " ", badge(ev.type, g), " ", ...detail(ev)));
  }

  const stop = new AbortController();
  const follow = sb.state !== "deleted";
  lines(`/v1/sandboxes/${sb.id}/events/stream${query({ follow: follow || undefined })}`, (ev) => {
    add(ev);
    status.textContent = follow ? `${timeline.children.length} events · live` : `${timeline.children.length} events`;
  }, { tenant: sb.tenant, signal: stop.signal })
    .then(() => { status.textContent = `${timeline.children.length} events`; })
    .catch((e) => { if (e.name !== "AbortError") status.textContent = e.message; });
  status.textContent = follow ? "live" : "";
  return () => stop.abort();
}
