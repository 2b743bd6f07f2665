// Elements are built from data with textContent only: nothing a sandbox controls
// (file names, command output, labels) is ever parsed as HTML.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const SVG = "http://www.w3.org/2000/svg";
export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "dataset") Object.assign(el.dataset, v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v);
  }
  return append(el, children);
}

export function age(iso) {
  if (!iso) return "";
  const secs = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
  if (secs < 60) return `${Math.floor(secs)}s`;
  if (secs < 3600) return `${Math.floor(secs / 60)}m`;
  if (secs < 86400) return `${Math.floor(secs / 3600)}h`;
  return `${Math.floor(secs / 86400)}d`;
}

export function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function mib(n) {
  return n === null || n === undefined ? "–" : `${Number(n).toFixed(0)} MiB`;
}

export function time(iso) {
  return iso ? new Date(iso).toLocaleTimeString() : "";
}

export function badge(text, kind) {
  return h("span", { class: `badge ${kind || text}` }, text);
}

export function toast(message, bad = false) {
  const t = document.getElementById("toast");
  t.textContent = message;
  t.className = bad ? "show bad" : "show";
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.className = ""; }, 4000);
}

// Resolves true when the person confirms in the modal dialog.
export function confirmAction(text) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = text;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "";
    dialog.showModal();
    document.getElementById("confirm-ok").focus();
  });
}

// A polled table redraws its rows: the control the keyboard was on is found again in the
// new row of the same data-id (or that row's first control, or `fallback` if it is gone).
const CONTROLS = "a[href], button, input, select";
export function replaceRows(body, fallback, rows) {
  const el = document.activeElement;
  const tr = el && body.contains(el) ? el.closest("tr") : null;
  const keep = tr ? { id: tr.dataset.id, at: [...tr.querySelectorAll(CONTROLS)].indexOf(el) } : null;
  body.replaceChildren(...rows);
  if (!keep) return;
  const again = [...body.rows].find((row) => row.dataset.id === keep.id);
  const controls = again ? [...again.querySelectorAll(CONTROLS)] : [];
  (controls[keep.at] || controls[0] || fallback).focus();
}
