// Eval runs recorded by `cella eval run`: pass/fail per task, durations, each task's trace.
import { api, session } from "../api.js";
import { age, badge, h } from "../dom.js";

export async function render(main, [runId]) {
  return runId ? run(main, runId) : runs(main);
}

async function runs(main) {
  const data = await api("GET", `/v1/evals${session.admin ? "?all_tenants=true" : ""}`);
  main.append(h("div", { class: "bar" }, h("h1", {}, "Eval runs")),
    data.runs.length ? h("table", { class: "list", id: "evals" },
      h("thead", {}, h("tr", {}, ["Run", "Snapshot", "Tasks", "Passed", "Failed", "Errors", "Started", "State"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, data.runs.map((r) => h("tr", { dataset: { id: r.id }, class: r.failed || r.errors ? "regressed" : "" },
        h("td", {}, h("a", { href: `#/evals/${r.id}` }, r.name || r.id), h("div", { class: "muted mono" }, r.id)),
        h("td", { class: "mono" }, r.snapshot_id),
        h("td", {}, String(r.tasks)),
        h("td", {}, badge(String(r.passed), "ok")),
        h("td", {}, badge(String(r.failed), r.failed ? "bad" : "quiet")),
        h("td", {}, badge(String(r.errors), r.errors ? "bad" : "quiet")),
        h("td", { title: r.created_at }, `${age(r.created_at)} ago`),
        h("td", {}, r.finished_at ? "finished" : "running")))))
      : h("p", {}, "No eval runs yet: ", h("code", {}, "cella eval run tasks.jsonl --snapshot S"), " records one here."));
  return null;
}

async function run(main, runId) {
  const r = await api("GET", `/v1/evals/${runId}`);
  const tenant = session.admin && r.tenant !== session.tenant ? `?tenant=${encodeURIComponent(r.tenant)}` : "";
  main.append(
    h("div", { class: "bar" }, h("h1", {}, r.name || r.id), h("span", { class: "muted" },
      `${r.passed} passed · ${r.failed} failed · ${r.errors} errors of ${r.tasks} · snapshot ${r.snapshot_id}`)),
    h("table", { class: "list", id: "results" },
      h("thead", {}, h("tr", {}, ["Task", "Result", "Score", "Duration", "Check", "Sandbox"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, r.results.map((t) => {
        const check = [...t.steps].reverse().find((st) => st.phase === "check");
        const verdict = t.error ? "error" : t.passed ? "pass" : "fail";
        return h("tr", { dataset: { task: t.task_id, result: verdict }, class: verdict },
          h("td", {}, t.task_id),
          h("td", {}, badge(verdict.toUpperCase(), verdict === "pass" ? "ok" : "bad"), t.error ? h("div", { class: "error" }, t.error) : null),
          h("td", {}, String(t.score)),
          h("td", {}, `${(t.duration_ms / 1000).toFixed(2)} s`),
          h("td", {}, check ? h("details", {}, h("summary", {}, `exit ${check.exit_code}: `, h("code", {}, check.command)),
            h("pre", {}, (check.stdout + check.stderr).slice(-2000) || "(no output)")) : "–"),
          h("td", {}, t.sandbox_id ? h("a", { href: `#/sandboxes/${t.sandbox_id}/trace${tenant}` }, "trace") : "–"));
      }))));
  return null;
}
