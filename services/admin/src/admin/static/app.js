// tbmq-py admin UI: plain JavaScript over /api/v1 (docs/operations.md); charts are drawn as SVG here.
"use strict";
const API = "/api/v1";
const $ = (sel) => document.querySelector(sel);
let token = sessionStorage.getItem("tbmq-token");
// the role of the logged-in user (docs/operations.md, "Roles"): a viewer's page has no buttons that change things
const showRole = (role) => document.body.classList.toggle("viewer", role === "viewer");
showRole(sessionStorage.getItem("tbmq-role"));
let timer = null;
const series = { t: [], msgsIn: [], msgsOut: [], connected: [], lag: [] };  // polled overview samples
const MAX_POINTS = 120;

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

async function api(path, options = {}) {
  const headers = Object.assign({ "Content-Type": "application/json" }, options.headers || {});
  if (token) headers.Authorization = "Bearer " + token;
  const r = await fetch(API + path, Object.assign({}, options, { headers }));
  if (r.status === 401 && path !== "/auth/login") { showLogin("Session expired: log in again"); throw new Error("401"); }
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.error || ("HTTP " + r.status));
  return body;
}

function showLogin(message) {
  token = null; sessionStorage.removeItem("tbmq-token"); sessionStorage.removeItem("tbmq-role");
  if (timer) { clearInterval(timer); timer = null; }
  $("#app").hidden = true; $("#login").hidden = false;
  $("#login-error").textContent = message || "";
}

$("#login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  try {
    const r = await api("/auth/login", { method: "POST",
      body: JSON.stringify({ username: $("#username").value, password: $("#password").value }) });
    token = r.token; sessionStorage.setItem("tbmq-token", token);
    sessionStorage.setItem("tbmq-role", r.role); showRole(r.role);
    $("#login").hidden = true; $("#app").hidden = false;
    route();
  } catch (e) { $("#login-error").textContent = "Login failed: " + e.message; }
});

$("#logout").addEventListener("click", async () => {
  try { await api("/auth/logout", { method: "POST" }); } catch (e) { /* expired anyway */ }
  showLogin("Logged out");
});

function table(columns, rows, actions) {
  const head = columns.map(([, title]) => `<th>${esc(title)}</th>`).join("") + (actions ? "<th></th>" : "");
  const body = rows.map((row, i) => "<tr>" + columns.map(([key]) => {
    const v = typeof key === "function" ? key(row) : row[key];
    return `<td>${esc(v)}</td>`;
  }).join("") + (actions ? `<td>${actions(row, i)}</td>` : "") + "</tr>").join("");
  return `<table><thead><tr>${head}</tr></thead><tbody>${body || `<tr><td colspan="${columns.length + 1}">none</td></tr>`}</tbody></table>`;
}

// -- SVG line chart ---------------------------------------------------------------------------------------
function chart(title, xs, lines) {
  const W = 420, H = 160, L = 48, B = 20;
  const all = lines.flatMap((l) => l.values).filter((v) => v !== null);
  const max = Math.max(1, ...all);
  const x0 = xs[0] || 0, x1 = xs[xs.length - 1] || 1;
  const px = (x) => L + (x1 === x0 ? 0 : (x - x0) / (x1 - x0)) * (W - L - 8);
  const py = (y) => H - B - (y / max) * (H - B - 8);
  let svg = `<svg viewBox="0 0 ${W} ${H}" width="100%" role="img" aria-label="${esc(title)}">`;
  svg += `<line x1="${L}" y1="${H - B}" x2="${W - 8}" y2="${H - B}" stroke="#999"/><line x1="${L}" y1="8" x2="${L}" y2="${H - B}" stroke="#999"/>`;
  svg += `<text x="${L - 4}" y="14" font-size="10" text-anchor="end">${esc(Math.round(max))}</text><text x="${L - 4}" y="${H - B}" font-size="10" text-anchor="end">0</text>`;
  if (xs.length) {
    svg += `<text x="${L}" y="${H - 4}" font-size="10">${esc(new Date(x0).toLocaleTimeString())}</text>`;
    svg += `<text x="${W - 8}" y="${H - 4}" font-size="10" text-anchor="end">${esc(new Date(x1).toLocaleTimeString())}</text>`;
  }
  for (const l of lines) {
    const pts = l.values.map((v, i) => v === null ? null : `${px(xs[i]).toFixed(1)},${py(v).toFixed(1)}`).filter(Boolean);
    svg += `<polyline fill="none" stroke="${l.color}" stroke-width="2" points="${pts.join(" ")}"/>`;
    for (const p of pts) { const [cx, cy] = p.split(","); svg += `<circle cx="${cx}" cy="${cy}" r="2.5" fill="${l.color}"/>`; }
  }
  svg += "</svg>";
  const legend = lines.map((l) => `<span style="color:${l.color}">■ ${esc(l.name)}</span>`).join("");
  return `<div class="chart"><h3>${esc(title)}</h3>${svg}<div class="legend">${legend}</div></div>`;
}

function rate(values, times) {  // per second between samples
  return values.map((v, i) => i === 0 ? null : Math.max(0, (v - values[i - 1]) / Math.max(0.001, (times[i] - times[i - 1]) / 1000)));
}

// -- pages --------------------------------------------------------------------------------------------------
const pages = {
  async overview(el) {
    const o = await api("/overview");
    series.t.push(o.time_ms); series.msgsIn.push(o.messages_in_total); series.msgsOut.push(o.messages_out_total);
    series.connected.push(o.connected); series.lag.push(o.application_lag);
    for (const k of Object.keys(series)) if (series[k].length > MAX_POINTS) series[k].shift();
    const stats = (await api("/stats?limit=60")).items;
    const cards = [["Sessions", o.sessions], ["Connected", o.connected], ["Subscriptions", o.subscriptions],
      ["Shared groups", o.shared_groups], ["Retained", o.retained], ["APPLICATION lag", o.application_lag],
      ["Messages in", o.messages_in_total], ["Messages out", o.messages_out_total]];
    let html = `<h2>Overview</h2><div class="cards">${cards.map(([k, v]) => `<div class="card" data-card="${esc(k)}">${esc(k)}<b>${esc(v)}</b></div>`).join("")}</div><div class="charts">`;
    html += chart("Messages per second (live)", series.t, [
      { name: "in", color: "#1a73e8", values: rate(series.msgsIn, series.t) },
      { name: "out", color: "#e8710a", values: rate(series.msgsOut, series.t) }]);
    html += chart("Connections (live)", series.t, [{ name: "connected", color: "#137333", values: series.connected }]);
    html += chart("Kafka lag of APPLICATION clients (live)", series.t, [{ name: "records", color: "#a142f4", values: series.lag }]);
    const st = stats.map((w) => w.window_start_ms);
    html += chart("Messages per window (Spark statistics)", st, [
      { name: "incoming", color: "#1a73e8", values: stats.map((w) => w.totals.incoming_msgs ?? 0) },
      { name: "outgoing", color: "#e8710a", values: stats.map((w) => w.totals.outgoing_msgs ?? 0) }]);
    html += chart("Connected sessions per window (Spark statistics)", st, [
      { name: "connected", color: "#137333", values: stats.map((w) => w.totals.sessions_connected ?? 0) }]);
    el.innerHTML = html + "</div>";
  },

  async sessions(el) {
    const q = new URLSearchParams(location.hash.split("?")[1] || "");
    const params = new URLSearchParams();
    for (const k of ["client_id", "connected", "client_type", "offset"]) if (q.get(k)) params.set(k, q.get(k));
    const r = await api("/sessions?" + params);
    el.innerHTML = `<h2>Sessions (${r.total})</h2>
      <form class="filters" id="session-filter">
        <label>Client id prefix <input name="client_id" value="${esc(q.get("client_id") || "")}"></label>
        <label>Connected <select name="connected"><option value="">any</option><option value="true">yes</option><option value="false">no</option></select></label>
        <label>Type <select name="client_type"><option value="">any</option><option>DEVICE</option><option>APPLICATION</option></select></label>
        <button type="submit">Filter</button></form>` +
      table([["client_id", "Client id"], ["client_type", "Type"], [(s) => s.connected ? "yes" : "no", "Connected"],
        ["service_id", "Connector"], ["mqtt_version", "MQTT"], ["session_expiry_interval", "Expiry (s)"],
        ["client_address", "Address"], [(s) => s.connected_at_ms ? new Date(s.connected_at_ms).toLocaleString() : "", "Connected at"]],
        r.items, (s) => (s.connected ? `<button data-write data-disconnect="${esc(s.client_id)}">Disconnect</button> ` : "") +
          `<button data-write data-clear="${esc(s.client_id)}">Clear</button>`) + pager(r, "sessions", q);
    el.querySelector("[name=connected]").value = q.get("connected") || "";
    el.querySelector("[name=client_type]").value = q.get("client_type") || "";
    el.querySelector("#session-filter").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const f = new URLSearchParams(new FormData(ev.target));
      for (const [k, v] of [...f]) if (!v) f.delete(k);
      location.hash = "sessions?" + f;
    });
    el.querySelectorAll("[data-disconnect]").forEach((b) => b.addEventListener("click", async () => {
      await api(`/sessions/${encodeURIComponent(b.dataset.disconnect)}/disconnect`, { method: "POST" }); b.disabled = true;
    }));
    el.querySelectorAll("[data-clear]").forEach((b) => b.addEventListener("click", async () => {
      if (confirm(`Clear the session of ${b.dataset.clear}?`)) {
        await api(`/sessions/${encodeURIComponent(b.dataset.clear)}`, { method: "DELETE" }); b.disabled = true;
      }
    }));
  },

  async subscriptions(el) {
    const q = new URLSearchParams(location.hash.split("?")[1] || "");
    const params = new URLSearchParams();
    for (const k of ["topic_filter", "client_id", "offset"]) if (q.get(k)) params.set(k, q.get(k));
    const r = await api("/subscriptions?" + params);
    el.innerHTML = `<h2>Subscriptions (${r.total})</h2>
      <form class="filters" id="sub-filter"><label>Topic filter contains <input name="topic_filter" value="${esc(q.get("topic_filter") || "")}"></label>
      <button type="submit">Filter</button></form>` +
      table([["client_id", "Client id"], ["topic_filter", "Topic filter"], ["share_name", "Share name"], ["qos", "QoS"],
        [(s) => s.no_local ? "yes" : "", "No local"], ["subscription_id", "Subscription id"]], r.items) + pager(r, "subscriptions", q);
    el.querySelector("#sub-filter").addEventListener("submit", (ev) => {
      ev.preventDefault();
      location.hash = "subscriptions?" + new URLSearchParams({ topic_filter: ev.target.topic_filter.value });
    });
  },

  async shared(el) {
    const r = await api("/shared-subscriptions");
    el.innerHTML = `<h2>Shared-subscription groups (${r.total})</h2>` + table([["share_name", "Share name"],
      ["topic_filter", "Topic filter"], [(g) => g.members.map((m) => m.client_id).join(", "), "Members"]], r.items);
  },

  async retained(el) {
    const r = await api("/retained");
    el.innerHTML = `<h2>Retained messages (${r.total})</h2>` + table([["topic", "Topic"], ["qos", "QoS"],
      [(m) => m.payload_text ?? ("0x" + m.payload_hex), "Payload"], ["payload_size", "Bytes"], ["publisher_id", "Publisher"],
      [(m) => m.created_at_ms ? new Date(m.created_at_ms).toLocaleString() : "", "Created"]], r.items,
      (m) => `<button data-write data-delete="${esc(m.topic)}">Delete</button>`);
    el.querySelectorAll("[data-delete]").forEach((b) => b.addEventListener("click", async () => {
      await api("/retained/" + encodeURIComponent(b.dataset.delete), { method: "DELETE" }); route();
    }));
  },

  async credentials(el) {
    const r = await api("/credentials");
    el.innerHTML = `<h2>Credentials (${r.total})</h2>
      <form class="filters" id="cred-form"><label>User <input name="username" required></label>
      <label>Password <input name="password" type="password"></label>
      <label>Client id pattern <input name="client_id" placeholder="%u-*"></label>
      <label>Publish <input name="pub" placeholder="devices/%c/#"></label>
      <label>Subscribe <input name="sub" placeholder="devices/%c/+"></label>
      <button type="submit">Save</button> <span class="error" id="cred-error"></span></form>` +
      table([["username", "User"], [(c) => c.password ? "yes" : "", "Password"], ["client_id", "Client id pattern"],
        ["cert_cn", "Certificate"], [(c) => c.pub.join(" "), "Publish"], [(c) => c.sub.join(" "), "Subscribe"]], r.items,
        (c) => `<button data-delete="${esc(c.username)}">Delete</button>`);
    const split = (v) => v.split(/[\s,]+/).filter(Boolean);
    el.querySelector("#cred-form").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const f = ev.target;
      const body = { client_id: f.client_id.value || null, pub: split(f.pub.value), sub: split(f.sub.value) };
      if (f.password.value) body.password = f.password.value;
      try { await api("/credentials/" + encodeURIComponent(f.username.value), { method: "PUT", body: JSON.stringify(body) }); route(); }
      catch (e) { el.querySelector("#cred-error").textContent = e.message; }
    });
    el.querySelectorAll("[data-delete]").forEach((b) => b.addEventListener("click", async () => {
      await api("/credentials/" + encodeURIComponent(b.dataset.delete), { method: "DELETE" }); route();
    }));
  },

  async blocked(el) {
    const [r, bans, tokens] = await Promise.all([api("/blocked"), api("/login-bans"), api("/revoked-tokens")]);
    el.innerHTML = `<h2>Blocked clients (${r.total})</h2>
      <form class="filters" id="block-form" data-write><label>Kind <select name="kind"><option>client_id</option><option>username</option>
      <option>ip</option><option>regex</option></select></label><label>Value <input name="value" required></label>
      <label>Expires in (s) <input name="expires_in_s" type="number" min="1"></label>
      <label>Reason <input name="reason"></label><button type="submit">Block</button> <span class="error" id="block-error"></span></form>` +
      table([["key", "Rule"], ["reason", "Reason"], [(b) => b.expires_at_ms ? new Date(b.expires_at_ms).toLocaleString() : "never", "Expires"],
        [(b) => b.active ? "active" : "expired", "State"]], r.items, (b) => `<button data-write data-delete="${esc(b.key)}">Unblock</button>`) +
      `<h2>Login bans (${bans.total})</h2><p>Addresses past MQTT_LOGIN_FAILURES_PER_IP, refused by every connector until the ban ends.</p>` +
      table([["address", "Address"], [(b) => new Date(b.until_ms).toLocaleString(), "Until"], ["by", "Banned by"]], bans.items,
        (b) => `<button data-write data-lift="${esc(b.address)}">Lift</button>`) +
      `<h2>Revoked tokens (${tokens.total})</h2><p>MQTT JSON Web Tokens (provider jwt) refused by every connector, their connections closed, until their exp.</p>
      <form class="filters" id="revoke-form" data-write><label>Token <input name="token" placeholder="the JWT, or its jti and exp"></label>
      <label>jti <input name="jti"></label><label>exp (Unix s) <input name="exp" type="number" min="1"></label>
      <button type="submit">Revoke</button> <span class="error" id="revoke-error"></span></form>` +
      table([["jti", "Token id (jti)"], [(t) => new Date(t.exp * 1000).toLocaleString(), "Until (its exp)"]], tokens.items,
        (t) => `<button data-write data-withdraw="${esc(t.jti)}">Withdraw</button>`);
    el.querySelector("#revoke-form").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const f = ev.target;
      const body = f.token.value ? { token: f.token.value.trim() } : { jti: f.jti.value, exp: Number(f.exp.value) };
      try { await api("/revoked-tokens", { method: "POST", body: JSON.stringify(body) }); route(); }
      catch (e) { el.querySelector("#revoke-error").textContent = e.message; }
    });
    el.querySelectorAll("[data-withdraw]").forEach((b) => b.addEventListener("click", async () => {
      await api("/revoked-tokens/" + encodeURIComponent(b.dataset.withdraw), { method: "DELETE" }); route();
    }));
    el.querySelector("#block-form").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const f = ev.target;
      const body = { kind: f.kind.value, value: f.elements.value.value, reason: f.reason.value };
      if (f.expires_in_s.value) body.expires_in_s = Number(f.expires_in_s.value);
      try { await api("/blocked", { method: "POST", body: JSON.stringify(body) }); route(); }
      catch (e) { el.querySelector("#block-error").textContent = e.message; }
    });
    el.querySelectorAll("[data-delete]").forEach((b) => b.addEventListener("click", async () => {
      await api("/blocked/" + encodeURIComponent(b.dataset.delete), { method: "DELETE" }); route();
    }));
    el.querySelectorAll("[data-lift]").forEach((b) => b.addEventListener("click", async () => {
      await api("/login-bans/" + encodeURIComponent(b.dataset.lift), { method: "DELETE" }); route();
    }));
  },

  async applications(el) {
    const r = await api("/applications");
    el.innerHTML = `<h2>APPLICATION clients (${r.total})</h2>` + table([["client_id", "Client id"],
      [(a) => a.connected ? "yes" : "no", "Connected"], [(a) => a.kafka.topic, "Topic"], [(a) => a.kafka.group, "Consumer group"],
      [(a) => a.kafka.lag ?? a.kafka.error, "Lag (records)"]], r.items);
  },

  async services(el) {
    const r = await api("/services");
    el.innerHTML = `<h2>Services</h2>` + table([["service", "Service"], ["instance", "Instance"], ["address", "Health endpoint"],
      [(s) => s.ready ? "ready" : "NOT READY", "State"]], r.items);
    el.querySelectorAll("td:nth-child(4)").forEach((td) => td.className = td.textContent === "ready" ? "ok" : "bad");
  },
};

function pager(r, page, q) {
  if (r.next_offset === null && !r.offset) return "";
  const prev = Math.max(0, r.offset - r.limit);
  const link = (off, text) => { const p = new URLSearchParams(q); p.set("offset", off); return `<a href="#${page}?${p}">${text}</a>`; };
  return `<p>${r.offset ? link(prev, "← previous") : ""} ${r.offset + 1}–${r.offset + r.items.length} of ${r.total} ${r.next_offset !== null ? link(r.next_offset, "next →") : ""}</p>`;
}

async function route() {
  if (!token) return showLogin();
  const name = (location.hash.slice(1).split("?")[0]) || "overview";
  const page = pages[name] || pages.overview;
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.getAttribute("href") === "#" + name));
  if (timer) { clearInterval(timer); timer = null; }
  const el = $("#page");
  el.dataset.page = name;
  el.dataset.shown = "";
  el.innerHTML = "<p>Loading…</p>";
  const refresh = async () => {
    // a list is not re-drawn under the operator's hands: not while a filter field has the focus
    if (el.dataset.shown === name && name !== "overview" && el.contains(document.activeElement)
        && document.activeElement.matches("input, select")) return;
    try { await page(el); el.dataset.shown = name; }
    catch (e) { if (e.message !== "401") el.innerHTML = `<p class="error">${esc(e.message)}</p>`; }
  };
  await refresh();
  // the overview's charts and the lists follow the suite: polled (lists less often, so filters stay usable)
  if (token) timer = setInterval(refresh, name === "overview" ? 3000 : 5000);
}

window.addEventListener("hashchange", route);
if (token) { $("#app").hidden = false; route(); } else { showLogin(); }
