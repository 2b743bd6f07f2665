// The REST API as the page uses it: the session cookie authenticates, the CSRF token
// goes with every change, an admin acting on another tenant's sandbox says so.
export const session = { tenant: null, admin: false, read_only: false, csrf: null };

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export async function loadSession() {
  const r = await fetch("/ui/session", { credentials: "same-origin" });
  if (r.status === 401) {
    location.href = "/ui/login";
    throw new ApiError(401, "unauthenticated", "not logged in");
  }
  Object.assign(session, await r.json());
  return session;
}

function headers(method, tenant, extra) {
  const h = { ...(extra || {}) };
  if (!["GET", "HEAD"].includes(method)) h["X-CSRF-Token"] = session.csrf;
  if (tenant && session.admin && tenant !== session.tenant) h["X-Cella-Tenant"] = tenant;
  return h;
}

export async function raw(method, path, { json, body, tenant, headers: extra, signal } = {}) {
  const init = { method, credentials: "same-origin", signal, headers: headers(method, tenant, extra) };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers["Content-Type"] = "application/json";
  } else if (body !== undefined) {
    init.body = body;
  }
  const r = await fetch(path, init);
  if (r.status === 401) location.href = "/ui/login";
  if (!r.ok) {
    let code = "http_error", message = `${r.status} ${r.statusText}`;
    try {
      const e = (await r.json()).error;
      if (e) ({ code, message } = e);
    } catch (_) { /* not JSON */ }
    throw new ApiError(r.status, code, message);
  }
  return r;
}

export async function api(method, path, opts = {}) {
  const r = await raw(method, path, opts);
  return r.status === 204 ? null : r.json();
}

// A JSON Lines stream, one parsed object at a time, until it ends or `signal` aborts it.
export async function lines(path, onItem, { tenant, signal } = {}) {
  const r = await raw("GET", path, { tenant, signal });
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl);
      buf = buf.slice(nl + 1);
      if (line.trim()) onItem(JSON.parse(line));
    }
  }
}

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v === undefined || v === null || v === "") continue;
    for (const item of Array.isArray(v) ? v : [v]) q.append(k, item);
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}

export async function download(path, filename, tenant) {
  const blob = await (await raw("GET", path, { tenant })).blob();
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = filename;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}
