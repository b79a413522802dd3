// The fleet page: polls /narwhal/state and redraws; drain and readmit buttons call the admin
// API. No dependencies; every value from the router is inserted as text, never as HTML
// (ejection reasons quote engine messages).
"use strict";

const POLL_MS = 1000;
const RECENT_MS = 5 * 60 * 1000;
const OUTCOMES = ["ok", "client_error", "timeout", "error", "client_closed"];
// Taken out by an operator, not by failure: not counted as out of service.
const DRAINED = ["draining", "drained"];
// Failure counters seen over the last minutes, to tell recent failures from old ones.
const history = [];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

function text(id, value) {
  document.getElementById(id).textContent = value;
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
}

// The router's own view: down only when no request can be placed; a phase without an
// admitted engine is still served (aggregate fallback, panic placement), degraded.
function serving(state) {
  if (state.can_serve === false) return "down";
  return state.degraded || outOfService(state).length ? "degraded" : "serving";
}

function outOfService(state) {
  return state.engines.filter((e) => e.state !== "admitted" && !DRAINED.includes(e.state));
}

function recentFailures(state, now) {
  history.push({ t: now, failures: Object.fromEntries(state.engines.map((e) => [e.id, e.failures])) });
  while (history.length > 1 && now - history[1].t >= RECENT_MS) history.shift();
  return history[0];
}

function renderRecent(recent) {
  text("rate", recent.rate_per_s.toFixed(recent.rate_per_s < 10 ? 2 : 0));
  text("window", `last ${Math.round(recent.window_s / 60)} min · ${recent.requests} requests`);
  const outcomes = document.getElementById("outcomes");
  outcomes.replaceChildren(
    ...OUTCOMES.filter((o) => recent.outcomes[o]).map((o) =>
      el("span", { class: `outcome o-${o}`, "data-outcome": o }, `${o.replace("_", " ")} ${recent.outcomes[o]}`),
    ),
  );
  if (!outcomes.children.length) outcomes.append(el("span", { class: "muted" }, "no requests yet"));
  const handoffs = Object.entries(recent.handoffs || {});
  document.getElementById("handoffs").replaceChildren(
    ...handoffs.map(([kind, n]) => el("span", { class: "outcome", "data-handoff": kind }, `${kind.replace("_", " ")} ${n}`)),
  );
  const peak = Math.max(1, ...recent.series.map((b) => OUTCOMES.reduce((n, o) => n + (b[o] || 0), 0)));
  document.getElementById("chart").replaceChildren(
    ...recent.series.map((bucket) =>
      el(
        "div",
        { class: "bar", title: `${bucket.ago_s} s ago` },
        ...OUTCOMES.filter((o) => bucket[o]).map((o) =>
          el("span", { class: `o-${o}`, style: `height:${(100 * bucket[o]) / peak}%` }),
        ),
      ),
    ),
  );
  for (const [row, values] of [["ttft", recent.ttft_s], ["first-byte", recent.first_byte_s]]) {
    const cells = document.getElementById(row).querySelectorAll("td");
    ["p50", "p90", "p99"].forEach((q, i) => {
      cells[i].textContent = seconds(values ? values[q] : null);
    });
  }
}

function seatRow(phase, seats) {
  const limit = seats.limit ? `/${seats.limit}` : "";
  const share = seats.limit ? Math.min(100, (100 * seats.in_use) / seats.limit) : seats.in_use ? 100 : 0;
  return el(
    "div",
    { class: "seat", "data-field": `seats-${phase}` },
    el("span", {}, phase),
    el("span", { class: "meter" }, el("span", { style: `width:${share}%` })),
    el("span", {}, `${seats.in_use}${limit}`),
  );
}

// The consumer's own count of prompt tokens pulled over KV transfer vs computed, beside the
// crossed decodes the router sent it; a silent recompute is flagged.
function kvFact(kv) {
  if (!kv || (!kv.crossed_decodes && kv.transfer_share == null)) return null;
  const share = kv.transfer_share == null ? "not reported" : `${Math.round(100 * kv.transfer_share)}% pulled`;
  const silent = kv.silent_recomputes ? ` · ${kv.silent_recomputes} silent recompute` : "";
  return el(
    "span",
    { "data-field": "kv", class: kv.silent_recomputes ? "recent-failure" : "" },
    `KV ${share} · ${kv.crossed_decodes} crossed decodes${silent}`,
  );
}

// A producer's handoffs dropped before any consumer got them, and the blocks they still pin
// (held until the engine's KV lease ends).
function abandonedFact(abandoned) {
  if (!abandoned || !abandoned.handoffs) return null;
  return el(
    "span",
    { "data-field": "abandoned", class: abandoned.pinned_blocks ? "recent-failure" : "" },
    `abandoned handoffs ${abandoned.handoffs} · ${abandoned.blocks} blocks · ` +
      `${abandoned.released} released · ${abandoned.pinned_blocks} pinned now`,
  );
}

function engineCard(engine, before) {
  const failures = Object.entries(engine.failures).filter(([, n]) => n > 0);
  const earlier = (before && before.failures[engine.id]) || {};
  const reason =
    engine.state === "ejected" && engine.ejection_reason
      ? engine.ejection_reason
      : engine.state === "quarantined"
        ? `quarantined for another ${engine.quarantined_for_s.toFixed(1)} s`
        : null;
  const probes = engine.probes || {};
  return el(
    "article",
    { class: "engine", "data-engine": engine.id, "data-state": engine.state },
    el(
      "div",
      { class: "engine-head" },
      el("span", { class: "engine-id" }, engine.id),
      engine.model ? el("span", { class: "badge model", "data-field": "model" }, engine.model) : null,
      el("span", { class: "badge", "data-field": "role" }, roleText(engine)),
      el("span", { class: "badge state", "data-field": "state", "data-state": engine.state }, engine.state),
    ),
    el("div", { class: "url" }, engine.url),
    engine.adapters && engine.adapters.length
      ? el("div", { class: "adapters", "data-field": "adapters" }, `adapters ${engine.adapters.join(", ")}`)
      : null,
    acting(engine) !== "decode" ? seatRow("prefill", engine.seats.prefill) : null,
    acting(engine) !== "prefill" ? seatRow("decode", engine.seats.decode) : null,
    el(
      "div",
      { class: "facts" },
      el("span", { "data-field": "streak" }, `streak ${engine.streak ?? 0}`),
      el("span", {}, `ejections ${engine.ejections ?? 0}`),
      engine.spared ? el("span", { "data-field": "spared" }, `spared ${engine.spared}`) : null,
      engine.panic_placements
        ? el("span", { "data-field": "panic" }, `panic placements ${engine.panic_placements}`)
        : null,
      kvFact(engine.kv),
      engine.pinned ? el("span", { "data-field": "pinned" }, "pinned") : null,
      engine.removing ? el("span", { "data-field": "removing" }, "leaving: not in the config file") : null,
      abandonedFact(engine.abandoned),
      Object.keys(probes).length
        ? el("span", {}, `probes ${Object.entries(probes).map(([k, n]) => `${k} ${n}`).join(", ")}`)
        : null,
    ),
    reason ? el("p", { class: "reason", "data-field": "reason" }, reason) : null,
    actions(engine),
    failures.length
      ? el(
          "ul",
          { class: "failures", "data-field": "failures" },
          ...failures.map(([cause, n]) => {
            const fresh = n - (earlier[cause] || 0);
            return el(
              "li",
              {},
              el("span", {}, cause.replaceAll("_", " ")),
              el("span", {}, fresh > 0 ? el("span", { class: "recent-failure" }, `+${fresh} recently · `) : null, `${n}`),
            );
          }),
        )
      : null,
  );
}

// One pool's line: admitted engines of each phase out of those serving it, and its adapters
// with how many engines hold each.
function poolSummary(pool) {
  const phases = Object.entries(pool.engines).map(([phase, ids]) => `${phase} ${pool.admitted[phase]}/${ids.length}`);
  const adapters = Object.entries(pool.adapters || {}).map(([name, ids]) => `${name} (${ids.length})`);
  return `${phases.join(" · ")} admitted${pool.can_serve ? "" : " · down"}${adapters.length ? ` · adapters ${adapters.join(", ")}` : ""}`;
}

// The engines, one group per pool (base model) when there are several; else one grid.
function renderEngines(state, before) {
  const container = document.getElementById("engines");
  const pools = Object.entries(state.models || {});
  if (pools.length <= 1) {
    container.className = "engines";
    container.replaceChildren(...state.engines.map((e) => engineCard(e, before)));
    return;
  }
  container.className = "pools";
  const known = new Set(pools.map(([model]) => model));
  const groups = pools.map(([model, pool]) => [model, pool, state.engines.filter((e) => e.model === model)]);
  const stray = state.engines.filter((e) => !known.has(e.model));
  if (stray.length) groups.push(["other", null, stray]);
  container.replaceChildren(
    ...groups.map(([model, pool, engines]) =>
      el(
        "section",
        { class: "pool", "data-model": model },
        el(
          "h3",
          {},
          el("span", { "data-field": "pool-model" }, model),
          " ",
          pool ? el("span", { class: "muted", "data-field": "pool-summary" }, poolSummary(pool)) : null,
        ),
        el("div", { class: "engines" }, ...engines.map((e) => engineCard(e, before))),
      ),
    ),
  );
}

// The phase an engine serves now; a role both engine may act in one phase only.
function acting(engine) {
  return engine.acting || engine.role;
}

function roleText(engine) {
  return acting(engine) === engine.role ? engine.role : `${engine.role}: ${acting(engine)}`;
}

// A count out of its cap, when there is one.
function ofCap(count, cap) {
  return cap === null || cap === undefined ? `${count}` : `${count}/${cap}`;
}

// A bucket's level or limit: whole units, thousands as k.
function amount(value) {
  if (value === null || value === undefined) return "–";
  if (value >= 10000) return `${Math.round(value / 1000)}k`;
  if (value >= 1000) return `${(value / 1000).toFixed(1)}k`;
  return `${Math.floor(value)}`;
}

// A tenant's per-minute buckets, level out of this router's share of the limit, and its
// time-to-first-token objective.
function tenantLimits(tenant) {
  const limits = tenant.limits || {};
  const share = tenant.share || {};
  const parts = [];
  for (const [label, key, level] of [["rpm", "requests_per_minute", "requests_level"], ["tpm", "tokens_per_minute", "tokens_level"]]) {
    const limit = share[key] ?? limits[key];
    if (limit !== null && limit !== undefined) parts.push(`${label} ${amount(tenant[level])}/${amount(limit)}`);
  }
  if (limits.ttft_objective_s !== null && limits.ttft_objective_s !== undefined) parts.push(`ttft ${seconds(limits.ttft_objective_s)}`);
  return parts.join(" · ") || "–";
}

// With tenants: one row each, its band, weight, requests in flight and queued (out of its
// caps), the last minutes' ok and refused requests, and its buckets; hidden without.
function renderTenants(state) {
  const section = document.getElementById("tenants");
  const tenants = Object.entries(state.tenants || {});
  if (!tenants.length) {
    section.hidden = true;
    return;
  }
  section.hidden = false;
  const recent = (state.recent && state.recent.tenants) || {};
  const fallback = tenants.find(([, t]) => t.default);
  const minutes = state.recent ? Math.round(state.recent.window_s / 60) : 5;
  text("tenants-note", `ok and refused: last ${minutes} min${fallback ? ` · default ${fallback[0]}` : ""}`);
  document.getElementById("tenant-rows").replaceChildren(
    ...tenants.map(([name, tenant]) => {
      const limits = tenant.limits || {};
      const share = tenant.share || {};
      const seen = recent[name] || {};
      const inFlight = tenant.in_flight ?? tenant.in_flight_here ?? 0;
      const cells = [
        ["name", name],
        ["band", `${tenant.priority ?? 0}`],
        ["weight", `${tenant.weight ?? 1}`],
        ["in-flight", ofCap(inFlight, share.max_concurrent ?? limits.max_concurrent)],
        ["queued", ofCap(tenant.queued ?? 0, limits.max_queued)],
        ["ok", `${(seen.outcomes || {}).ok || 0}`],
        ["refused", `${seen.refused || 0}`],
        ["limits", tenantLimits(tenant)],
      ];
      return el(
        "tr",
        { "data-tenant": name },
        ...cells.map(([field, value]) =>
          el("td", { "data-field": field, class: field === "refused" && seen.refused ? "recent-failure" : "" }, value),
        ),
      );
    }),
  );
}

// The role controller, when enabled: its split, last decision and recent role changes.
function renderController(controller) {
  const section = document.getElementById("controller");
  if (!controller || !controller.enabled) {
    section.hidden = true;
    return;
  }
  section.hidden = false;
  const split = controller.split || {};
  text("controller-mode", controller.advisory ? "advisory: decides, changes nothing" : "on");
  text("controller-split", `${split.prefill ?? 0} prefill · ${split.decode ?? 0} decode · ${split.both ?? 0} both`);
  const last = controller.last_decision;
  text("controller-last", last ? `${last.move ? `move ${last.move.engine} ${last.move.from} → ${last.move.to}` : "hold"}: ${last.reason}, ${last.detail}` : "none yet");
  const items = [...(controller.timeline || [])].reverse().map((m) =>
    el(
      "li",
      {},
      `${new Date(m.ts * 1000).toLocaleTimeString()} ${m.engine} ${m.from} → ${m.to} (${m.reason})${m.applied ? "" : " advised"}`,
    ),
  );
  document.getElementById("controller-timeline").replaceChildren(...items);
}

// Drain (no new work; running requests finish) or, once draining or drained, readmit.
function actions(engine) {
  const action = DRAINED.includes(engine.state) ? "readmit" : "drain";
  const button = el("button", { type: "button", "data-action": action }, action);
  button.addEventListener("click", () => act(engine.id, action, false));
  return el("div", { class: "actions" }, button);
}

async function act(id, action, force) {
  const path = `/narwhal/engines/${encodeURIComponent(id)}/${action}${force ? "?force=true" : ""}`;
  const response = await fetch(path, { method: "POST", headers: authorization() });
  const answer = await response.json().catch(() => ({}));
  if (response.ok) {
    notice(`${action} ${id}: now ${answer.engine.state}`);
  } else {
    const message = (answer.error && answer.error.message) || `HTTP ${response.status}`;
    // A drain refused at a phase floor may be forced, on the operator's word.
    if (response.status === 409 && !force && message.includes("force=true") && window.confirm(`${message}\n\nDo it anyway?`)) {
      return act(id, action, true);
    }
    notice(`${action} ${id} refused: ${message}`, true);
  }
  await refresh();
}

function notice(message, refused) {
  const node = document.getElementById("notice");
  node.textContent = message;
  node.dataset.refused = refused ? "true" : "false";
}

function render(state) {
  const now = Date.now();
  const before = recentFailures(state, now);
  const models = Object.keys(state.models || {});
  text("model", models.length > 1 ? models.join(" · ") : state.model);
  text("in-flight", state.in_flight);
  text("queued", state.queued);
  text("credit", `${Math.floor(state.retry_budget.credit)}/${state.retry_budget.size}`);
  text("continued", `${state.continuation.continued}`);
  if (state.recent) renderRecent(state.recent);
  renderTenants(state);
  renderController(state.controller);
  renderEngines(state, before);
  const status = document.getElementById("status");
  const word = serving(state);
  status.dataset.status = word;
  const down = outOfService(state).length;
  status.textContent = word === "serving" ? "serving" : `${word}: ${down} of ${state.engines.length} engines out`;
}

// Routers with admin keys guard /narwhal/state; the key is kept for this tab only.
let adminKey = sessionStorage.getItem("narwhal-admin-key");

function authorization() {
  return adminKey ? { Authorization: `Bearer ${adminKey}` } : {};
}

async function refresh() {
  try {
    const response = await fetch("/narwhal/state", { cache: "no-store", headers: authorization() });
    if (response.status === 401) {
      adminKey = window.prompt("This router needs its admin key to show the fleet:");
      if (adminKey) sessionStorage.setItem("narwhal-admin-key", adminKey);
      else sessionStorage.removeItem("narwhal-admin-key");
      throw new Error("admin key required");
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (error) {
    const status = document.getElementById("status");
    status.dataset.status = "unreachable";
    status.textContent = `router unreachable (${error.message})`;
  }
}

async function poll() {
  await refresh();
  setTimeout(poll, POLL_MS);
}

poll();
