// The sandbox's trace as a timeline that follows new events as they happen; a command's
// entry opens to the tree of processes it started and the connections they made, and its
// file changes follow it.
import { api, download, lines, query } from "../api.js";
import { badge, bytes, h, time } from "../dom.js";

const GROUPS = {
  exec: ["exec"],
  processes: ["process", "process_summary"],
  files: ["file_changes", "file_write", "file_remove", "file_move", "mkdir", "chmod", "chown"],
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

function ended(d) {
  if (d.state === "running") return badge("running", "exec");
  if (d.signal) return badge(`signal ${d.signal}`, "bad");
  return badge(`exit ${d.exit_code}`, d.exit_code === 0 ? "ok" : "bad");
}

function connection(c) {
  const allowed = c.allowed ?? false;
  const sizes = c.bytes_in !== undefined ? ` · ${bytes(c.bytes_out)} out · ${bytes(c.bytes_in)} in · ${c.duration_ms} ms` : "";
  return h("li", { class: "conn" }, "→ ", badge(allowed ? "allowed" : "denied", allowed ? "ok" : "bad"), " ",
    h("code", {}, `${c.host ?? ""}${c.port ? `:${c.port}` : ""}`), h("span", { class: "muted" }, sizes));
}

// The exec's processes under their parents (the latest of that pid started before each),
// a process reported running and then exited shown once, as exited.
function processTree(events, sb) {
  const procs = new Map();
  let summary = null;
  const conns = [];
  for (const ev of events) {
    if (ev.type === "process") procs.set(`${ev.data.pid}@${ev.data.started_at}`, { ...ev.data, kids: [], conns: [] });
    else if (ev.type === "process_summary") summary = ev.data;
    else if (ev.type === "egress" && ev.data.process) conns.push(ev.data);
  }
  const nodes = [...procs.values()].sort((a, b) => (a.started_at || "").localeCompare(b.started_at || "") || a.pid - b.pid);
  const roots = [];
  for (const n of nodes) {
    const parent = nodes.filter((p) => p !== n && p.pid === n.ppid && (p.started_at || "") <= (n.started_at || "")).pop();
    (parent ? parent.kids : roots).push(n);
  }
  const loose = [];
  for (const c of conns) {
    const owner = nodes.filter((n) => n.pid === c.process.pid).pop();
    (owner ? owner.conns : loose).push(c);
  }
  const item = (n) => h("li", { dataset: { pid: n.pid } },
    h("code", {}, `${n.pid} ${(n.argv || []).join(" ")}`), " ", ended(n),
    n.cpu_ms != null ? h("span", { class: "muted" }, ` ${n.cpu_ms} ms CPU`) : null,
    n.conns.length || n.kids.length ? h("ul", {}, ...n.conns.map(connection), ...n.kids.map(item)) : null);
  const tail = summary === null ? h("p", { class: "muted" }, "processes still running")
    : summary.truncated ? h("p", {}, badge("truncated", "bad"), ` ${summary.total} processes, ${summary.dropped} counted only`)
    : h("p", { class: "muted" }, `${summary.total} processes`);
  return [h("ul", { class: "proctree", "aria-label": "Process tree" }, ...roots.map(item), ...loose.map(connection)), tail];
}

function processes(ev, sb) {
  const box = h("div", {}, h("span", { class: "muted" }, "loading…"));
  const opened = h("details", { class: "procs", ontoggle: async (e) => {
    if (!e.target.open || opened.dataset.loaded) return;
    opened.dataset.loaded = "1";
    try {
      const path = `/v1/sandboxes/${sb.id}/events${query({ exec: ev.id, limit: 10000 })}`;
      const { events } = await api("GET", path, { tenant: sb.tenant });
      box.replaceChildren(...processTree(events, sb));
    } catch (err) {
      box.replaceChildren(h("span", { class: "muted" }, err.message));
    }
  } }, h("summary", {}, "processes and connections"), box);
  return opened;
}

function detail(ev, sb) {
  const d = ev.data || {};
  switch (ev.type) {
    case "exec": {
      const ok = d.exit_code === 0;
      return [
        h("code", { class: "cmd" }, command(d.command)),
        " ", badge(d.timed_out ? "timed out" : `exit ${d.exit_code}`, ok ? "ok" : "bad"),
        " ", h("span", { class: "muted" }, `${d.duration_ms} ms · ${bytes(d.stdout_bytes)} out · ${bytes(d.stderr_bytes)} err`),
        d.output_tail ? h("details", {}, h("summary", {}, "output tail"), h("pre", {}, d.output_tail)) : null,
        processes(ev, sb),
      ];
    }
    case "process":
      return [h("code", {}, `${d.pid} ${(d.argv || []).join(" ")}`), " ", ended(d),
        h("span", { class: "muted" }, ` parent ${d.ppid} · exec ${d.exec}`)];
    case "process_summary":
      return [d.truncated ? badge("truncated", "bad") : "", h("span", { class: "muted" }, ` ${d.total} processes of exec ${d.exec} · ${d.dropped} counted only`)];
    case "file_changes": {
      const changes = d.changes || [];
      const row = (c) => h("li", {}, badge(c.change, c.change === "deleted" ? "bad" : "ok"), " ",
        h("code", {}, c.from ? `${c.from} → ${c.path}` : c.path), c.dir ? " (dir)" : "",
        h("span", { class: "muted" }, c.change === "deleted" || c.dir ? "" : ` ${bytes(c.size)}`));
      return [h("details", { class: "changes" },
        h("summary", {}, `${changes.length} files changed by exec ${d.parent}`,
          d.truncated ? [" ", badge(`+${d.truncated} more`, "bad")] : ""),
        h("ul", { "aria-label": "File changes" }, ...changes.map(row)))];
    }
    case "file_write":
      return [h("code", {}, d.path), " ", h("span", { class: "muted" }, `${bytes(d.size)} · sha256 ${String(d.sha256 || "").slice(0, 16)}…`)];
    case "egress": {
      const allowed = d.allowed ?? d.action === "allow";
      return [badge(allowed ? "allowed" : "denied", allowed ? "ok" : "bad"), " ",
        h("code", {}, `${d.method ? `${d.method} ` : ""}${d.host ?? ""}${d.port ? `:${d.port}` : ""}${d.path ?? ""}`),
        " ", h("span", { class: "muted" }, d.reason || ""),
        d.process ? h("span", { class: "muted" }, ` · pid ${d.process.pid} `, h("code", {}, (d.process.argv || []).join(" "))) : null];
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
      h("time", { datetime: ev.at }, time(ev.at)), " ", badge(ev.type, g), " ", ...detail(ev, sb)));
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
