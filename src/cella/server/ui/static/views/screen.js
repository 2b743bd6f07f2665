// The screen of a desktop sandbox: a screenshot (GET .../screenshot, a PNG taken in the
// guest) drawn again every few seconds while the page is shown. The picture is the guest's:
// it is shown as an image from a blob, never as a page of the console's origin.
import { raw } from "../api.js";
import { h } from "../dom.js";

const EVERY_MS = 3000;

export async function render(body, sb) {
  const img = h("img", { id: "screen", alt: `The screen of ${sb.id}`, style: "max-width: 100%; border: 1px solid #8884" });
  const status = h("p", { class: "muted", role: "status" }, "taking a screenshot…");
  const note = h("p", { class: "muted" },
    "Refreshed every few seconds. For a live, interactive view, start the stream in the sandbox ",
    "(e2b-desktop's stream.start(), noVNC on port 6080) and open port 6080 from the overview (vnc.html).");
  body.append(status, img, note);
  let url = null, stopped = false;
  async function refresh() {
    try {
      const r = await raw("GET", `/v1/sandboxes/${sb.id}/screenshot`, { tenant: sb.tenant });
      const next = URL.createObjectURL(await r.blob());
      img.src = next;
      if (url) URL.revokeObjectURL(url);
      url = next;
      status.textContent = `taken ${new Date().toLocaleTimeString()}`;
    } catch (e) {
      status.textContent = e.message;
    }
  }
  await refresh();
  const timer = setInterval(() => { if (!document.hidden && !stopped && sb.state === "running") refresh(); }, EVERY_MS);
  return () => { stopped = true; clearInterval(timer); if (url) URL.revokeObjectURL(url); };
}
