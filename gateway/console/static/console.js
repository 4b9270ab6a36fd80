// InferFlux console: progressive enhancement only; every page works without it.
// Loaded as a file ('self'): the CSP allows no inline script, so nothing here is inlined in a page.
"use strict";

function cellText(value) {
  if (value === null || value === undefined) return "";
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (Array.isArray(value)) return value.join(", ");
  if (typeof value === "object") return Object.entries(value).map(([k, v]) => k + "=" + v).join(", ");
  return String(value);
}

// A console list path mirrors its admin API path: /console/<p> is GET /admin/v1/<p>, served as /console/api/<p>.
function apiOf(pathname) {
  return "/console/api/" + pathname.replace(/^\/console\//, "");
}

function confirmDangerous() {
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }
}

// Refreshes the cells of a list (the models' status while they load) from the JSON the page came from.
function refreshList(table, everyMs, keepGoing) {
  async function tick() {
    let answer;
    try {
      const response = await fetch(apiOf(location.pathname), { credentials: "same-origin" });
      if (!response.ok) return;
      answer = await response.json();
    } catch (_) {
      return setTimeout(tick, everyMs * 4);
    }
    const rows = answer.data || [];
    for (const row of rows) {
      const tr = table.querySelector(`tr[data-id="${CSS.escape(String(row.id))}"]`);
      if (!tr) continue;
      for (const td of tr.querySelectorAll("td[data-col]")) td.textContent = cellText(row[td.dataset.col]);
    }
    if (keepGoing(rows)) setTimeout(tick, everyMs);
  }
  if (keepGoing(null)) setTimeout(tick, everyMs);
}

function livePanel(table) {
  const status = document.getElementById("live-status");
  const source = new EventSource(table.dataset.source);
  source.onopen = () => { status.textContent = "Live."; };
  source.onerror = () => { status.textContent = "Disconnected; retrying…"; };
  source.onmessage = (event) => {
    const snapshot = JSON.parse(event.data);
    const body = document.createElement("tbody");
    for (const m of snapshot.models) {
      const tr = body.insertRow();
      for (const v of [m.model, m.waiting, m.running, m.kv_used, m.kv_free]) tr.insertCell().textContent = v;
      const meter = document.createElement("meter");
      meter.min = 0;
      meter.max = m.kv_used + m.kv_free || 1;
      meter.value = m.kv_used;
      tr.insertCell().append(meter);
      tr.insertCell().textContent = m.tokens_per_second.toFixed(1);
    }
    table.tBodies[0].replaceWith(body);
  };
}

document.addEventListener("DOMContentLoaded", () => {
  confirmDangerous();
  const key = document.getElementById("new-key-value");
  if (key) key.addEventListener("focus", () => key.select());
  const list = document.getElementById("rows");
  if (list && list.dataset.page === "models") {
    // While a model loads, its status and stage (progress) are polled each second; then polling stops.
    const loading = (rows) => (rows || [...list.querySelectorAll('td[data-col="status"]')].map((td) => ({ status: td.textContent })))
      .some((r) => r.status === "loading");
    refreshList(list, 1000, loading);
  } else if (list && list.dataset.page.endsWith("audit")) {
    // The tail is put together on the server (newest first over the API's pages): reload it.
    setInterval(() => { if (!document.hidden) location.reload(); }, 5000);
  }
  const live = document.getElementById("live");
  if (live) livePanel(live);
});
