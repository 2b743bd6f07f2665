// The family tree of a sandbox as a picture: sandbox → snapshots → forks, each node with
// its state (and, for eval branches, its score); every node links to its page.
import { api } from "../api.js";
import { h, s } from "../dom.js";

const W = 190, H = 54, GAP_X = 24, GAP_Y = 46;

// Leaves take the next column; a parent sits over the middle of its children.
function layout(node, depth = 0, next = { x: 0 }, out = []) {
  const item = { node, depth, x: 0, children: [] };
  out.push(item);
  for (const child of node.children || []) item.children.push(layout(child, depth + 1, next, out).item);
  if (item.children.length) item.x = (item.children[0].x + item.children[item.children.length - 1].x) / 2;
  else item.x = next.x++;
  return { item, out };
}

function label(node) {
  if (node.kind === "snapshot") return [`snapshot ${node.name || ""}`.trim(), node.id];
  const score = node.eval ? ` · ${node.eval.passed ? "pass" : "FAIL"} ${node.eval.score}` : "";
  return [`${node.id}`, `${node.state}${score}`];
}

export async function render(body, sb, here = sb.id) {
  const tree = await api("GET", `/v1/sandboxes/${sb.id}/lineage`, { tenant: sb.tenant });
  const { out } = layout(tree);
  const cols = Math.max(1, ...out.map((i) => i.x + 1));
  const rows = Math.max(1, ...out.map((i) => i.depth + 1));
  const width = cols * (W + GAP_X), height = rows * (H + GAP_Y);
  const svg = s("svg", { id: "lineage", viewBox: `0 0 ${width} ${height}`, width, height, role: "group", "aria-label": `Lineage of ${sb.id}` });
  const pos = (i) => [i.x * (W + GAP_X) + GAP_X / 2, i.depth * (H + GAP_Y) + GAP_Y / 2];
  for (const item of out) {
    const [x, y] = pos(item);
    for (const child of item.children) {
      const [cx, cy] = pos(child);
      svg.append(s("path", { class: "edge", d: `M${x + W / 2},${y + H} C${x + W / 2},${y + H + GAP_Y / 2} ${cx + W / 2},${cy - GAP_Y / 2} ${cx + W / 2},${cy}` }));
    }
  }
  const parents = new Map();
  for (const item of out) for (const c of item.children) parents.set(c, item.node.id);
  for (const item of out) {
    const n = item.node;
    const [x, y] = pos(item);
    const [top, bottom] = label(n);
    const classes = ["node", n.kind, n.state, n.eval ? (n.eval.passed ? "pass" : "fail") : "", n.id === here ? "here" : ""].join(" ");
    const tenant = sb.tenant ? `?tenant=${encodeURIComponent(sb.tenant)}` : "";
    const href = n.kind === "sandbox" ? `#/sandboxes/${n.id}/lineage${tenant}` : `#/snapshots?highlight=${n.id}`;
    svg.append(s("a", { href, class: classes, dataset: { id: n.id, kind: n.kind, state: n.state, parent: parents.get(item) || "" } },
      s("title", {}, `${n.kind} ${n.id} (${n.state})`),
      s("rect", { x, y, width: W, height: H, rx: 8 }),
      s("text", { x: x + 10, y: y + 21, class: "top" }, top),
      s("text", { x: x + 10, y: y + 41, class: "bottom" }, bottom)));
  }
  body.append(h("p", { class: "muted" }, "Snapshots and the forks made from them; click a node to open it."), h("div", { class: "scroll" }, svg));
  return null;
}
