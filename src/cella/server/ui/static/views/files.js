// The sandbox's files: browse, view, upload, download.
import { api, download, query, raw } from "../api.js";
import { bytes, h, toast } from "../dom.js";
import { may } from "./actions.js";

const VIEW_MAX = 1 << 20;

export async function render(body, sb) {
  let cwd = "/";
  const where = h("input", { id: "files-path", value: cwd, "aria-label": "Directory" });
  const go = h("button", { type: "submit" }, "Open");
  const upload = h("input", { id: "upload", type: "file", "aria-label": "Upload a file to this directory" });
  const list = h("tbody");
  const viewer = h("section", { id: "viewer", "aria-label": "File content" });
  // a key that may only view the sandbox reads its files, and is offered no upload
  const form = h("form", { class: "bar" }, h("label", { for: "files-path" }, "Directory"), where, go,
    ...(may(sb, "exec") ? [h("label", { for: "upload", class: "button" }, "Upload…"), upload] : []));
  body.append(form,
    h("div", { class: "cols" },
      h("table", { class: "list", id: "files" }, h("thead", {}, h("tr", {}, ["Name", "Size", "Mode", ""].map((c) => h("th", { scope: "col" }, c)))), list),
      viewer));
  const tenant = sb.tenant;
  const base = `/v1/sandboxes/${sb.id}/files`;
  const join = (dir, name) => (dir.endsWith("/") ? dir : `${dir}/`) + name;

  let asked = 0;
  async function open(dir) {
    const mine = ++asked;
    try {
      const entries = await api("GET", `${base}/list${query({ path: dir })}`, { tenant });
      if (mine !== asked) return; // a later request supersedes this one
      cwd = dir;
      where.value = dir;
      entries.sort((a, b) => (a.kind === "dir") === (b.kind === "dir") ? a.name.localeCompare(b.name) : a.kind === "dir" ? -1 : 1);
      const up = dir === "/" ? [] : [h("tr", {}, h("td", {}, h("a", { href: "#", onclick: (e) => { e.preventDefault(); open(dir.replace(/\/[^/]+\/?$/, "") || "/"); } }, "..")), h("td"), h("td"), h("td"))];
      list.replaceChildren(...up, ...entries.map((e) => {
        const path = join(dir, e.name);
        const link = h("a", { href: "#", dataset: { path, kind: e.kind }, onclick: (ev) => { ev.preventDefault(); if (e.kind === "dir") open(path); else view(path, e); } }, e.kind === "dir" ? `${e.name}/` : e.name);
        return h("tr", {}, h("td", {}, link), h("td", {}, e.kind === "dir" ? "" : bytes(e.size)), h("td", { class: "mono" }, (e.mode & 0o7777).toString(8)),
          h("td", {}, e.kind === "file" ? h("button", { type: "button", class: "small", onclick: () => download(`${base}/content${query({ path })}`, e.name, tenant).catch((err) => toast(err.message, true)) }, "download") : null));
      }));
    } catch (e) {
      toast(e.message, true);
    }
  }

  let viewing = 0;
  async function view(path, entry) {
    const mine = ++viewing;
    try {
      await show(path, entry, () => mine === viewing);
    } catch (e) {
      toast(e.message, true);
    }
  }

  async function show(path, entry, current) {
    viewer.replaceChildren(h("h2", {}, path));
    if (entry.size > VIEW_MAX) {
      viewer.append(h("p", {}, `${bytes(entry.size)}: too large to show here; download it.`));
      return;
    }
    const data = new Uint8Array(await (await raw("GET", `${base}/content${query({ path })}`, { tenant })).arrayBuffer());
    if (!current()) return; // another file was asked for meanwhile
    let text;
    try {
      text = new TextDecoder("utf-8", { fatal: true }).decode(data);
    } catch (_) {
      viewer.append(h("p", {}, `binary, ${bytes(data.length)}`));
      return;
    }
    viewer.append(h("pre", { class: "file" }, text));
  }

  form.addEventListener("submit", (ev) => { ev.preventDefault(); open(where.value || "/"); });
  upload.addEventListener("change", async () => {
    const file = upload.files[0];
    if (!file) return;
    const path = join(cwd, file.name);
    try {
      await raw("PUT", `${base}/content${query({ path })}`, { tenant, body: file, headers: { "Content-Type": "application/octet-stream" } });
      toast(`uploaded ${path}`);
      upload.value = "";
      await open(cwd);
    } catch (e) {
      toast(e.message, true);
    }
  });
  if (sb.state !== "running") {
    body.append(h("p", { class: "muted" }, `the sandbox is ${sb.state}: its files are readable once it runs`));
    return null;
  }
  await open("/");
  return null;
}
