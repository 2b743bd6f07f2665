// A terminal in the sandbox: xterm.js over the terminal WebSocket (a PTY in the guest).
import { session } from "../api.js";
import { h } from "../dom.js";

export function render(body, sb) {
  const status = h("p", { class: "muted", id: "terminal-status", "aria-live": "polite" }, "connecting…");
  const box = h("div", { id: "terminal", role: "application", "aria-label": "Terminal" });
  body.append(status, box);
  if (sb.state !== "running") {
    status.textContent = `the sandbox is ${sb.state}: resume it to open a terminal`;
    return null;
  }
  const term = new window.Terminal({ cursorBlink: true, convertEol: false, fontSize: 14, scrollback: 5000 });
  const fit = new window.FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(box);
  fit.fit();
  const q = new URLSearchParams({ cols: term.cols, rows: term.rows, csrf: session.csrf });
  if (session.admin && sb.tenant && sb.tenant !== session.tenant) q.set("tenant", sb.tenant);
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${scheme}://${location.host}/v1/sandboxes/${sb.id}/terminal?${q}`);
  ws.binaryType = "arraybuffer";
  const encoder = new TextEncoder();
  ws.onopen = () => { status.textContent = "connected"; term.focus(); };
  ws.onmessage = (ev) => {
    if (typeof ev.data === "string") {
      const msg = JSON.parse(ev.data);
      status.textContent = msg.type === "exit" ? `the shell exited (${msg.exit_code ?? msg.signal})` : `error: ${msg.message}`;
    } else {
      term.write(new Uint8Array(ev.data));
    }
  };
  ws.onclose = (ev) => {
    if (ev.code >= 4000) status.textContent = `refused: ${ev.reason}`;
    else if (status.textContent === "connected") status.textContent = "disconnected";
  };
  term.onData((data) => { if (ws.readyState === WebSocket.OPEN) ws.send(encoder.encode(data)); });
  term.onResize(({ cols, rows }) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "resize", cols, rows }));
  });
  const onResize = () => fit.fit();
  window.addEventListener("resize", onResize);
  return () => { window.removeEventListener("resize", onResize); ws.close(); term.dispose(); };
}
