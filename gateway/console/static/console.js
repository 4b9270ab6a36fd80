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

// Refreshes the status columns of a list (models while they load, the audit tail) from the JSON the page came from.
function refreshList(table, everyMs, keepGoing) {
  const columns = [...table.tHead.rows[0].cells].map((th) => th.textContent);
  async function tick() {
    let answer;
    try {
      const response = await fetch(apiOf(location.pathname) + "?limit=200", { credentials: "same-origin" });
      if (!response.ok) return;
      answer = await response.json();
    } catch (_) {
      return setTimeout(tick, everyMs * 4);
    }
    const rows = answer.data || [];
    if (table.dataset.page.endsWith("audit")) {
      const body = document.createElement("tbody");
      for (const row of rows) {
        const tr = body.insertRow();
        for (const c of columns) tr.insertCell().textContent = cellText(row[c]);
      }
      table.tBodies[0].replaceWith(body);
    } else {
      for (const row of rows) {
        const tr = table.querySelector(`tr[data-id="${CSS.escape(String(row.name ?? row.id))}"]`);
        if (!tr) continue;
        for (const td of tr.querySelectorAll("td[data-col]")) td.textContent = cellText(row[td.dataset.col]);
      }
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
    const loading = (rows) => (rows || [...list.querySelectorAll('td[data-col="status"]')].map((td) => ({ status: td.textContent })))
      .some((r) => /load/.test(String(r.status)));
    refreshList(list, 1000, loading);
  } else if (list && list.dataset.page.endsWith("audit")) {
    refreshList(list, 5000, () => true);
  }
  const live = document.getElementById("live");
  if (live) livePanel(live);
});
