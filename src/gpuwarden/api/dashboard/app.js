// gpuwarden dashboard: plain JavaScript, no framework, no build step.
// Every value from the API is put on the page as text (textContent), never as HTML.
"use strict";

(function () {
  const POLL_MS = 1000;          // without the event stream
  const POLL_LIVE_MS = 5000;     // with it (events also refresh at once)
  const POLL_HIDDEN_MS = 15000;  // while the tab is not shown
  const HISTORY_MS = 10000;
  const STATS_MS = 30000;
  const EVENTS_RETRY_MS = 30000;
  const FOOTPRINTS_SHOWN = 12;    // measured or run this week first
  // the kinds of the event log (SPEC.md section 9): a named event reaches only a
  // listener of its kind, so the page listens for each (and "message")
  const EVENT_KINDS = [
    "transition", "submitted", "cancel_requested", "cancel_passed_on", "memory_reclaimed",
    "gpu_fault", "gpu_fault_cleared", "gpu_xid", "gpu_degraded", "gpu_recovered",
    "gpu_clear_requested", "gpu_clear_ignored", "probe_failed", "probe_recovered",
    "footprint_raised", "eviction_skipped", "warm_server_starting", "warm_server_loaded",
    "warm_server_stopping", "warm_server_stopped", "leased", "node_state", "node_enrolled",
    "stale_report", "loop_error", "broker_started", "broker_stopping", "broker_stopped",
    "attempt_recovered", "bundle_accepted", "bundle_finished", "bundle_rejected", "message",
  ];

  const state = {
    session: null, overview: null, history: null, stats: null,
    live: false, source: null, timer: null, lastHistory: 0, lastStats: 0, debounce: null,
  };

  // -- helpers -------------------------------------------------------------------

  function $(id) { return document.getElementById(id); }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "style") Object.assign(node.style, v);
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  function fill(id, ...children) {
    const node = $(id);
    node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined));
    return node;
  }

  function gib(bytes) {
    const n = Number(bytes) || 0;
    if (n >= 1024 ** 3) return (n / 1024 ** 3).toFixed(1) + " GiB";
    return Math.round(n / 1024 ** 2) + " MiB";
  }

  function dur(seconds) {
    if (seconds === null || seconds === undefined) return "?";
    const s = Math.max(0, Math.round(Number(seconds)));
    if (s < 90) return s + " s";
    if (s < 5400) return Math.round(s / 60) + " min";
    if (s < 172800) return (s / 3600).toFixed(1) + " h";
    return (s / 86400).toFixed(1) + " d";
  }

  function clock(ts) {
    return ts ? new Date(ts * 1000).toLocaleTimeString() : "?";
  }

  function pct(part, total) {
    return total > 0 ? Math.max(0, Math.min(100, (100 * part) / total)) : 0;
  }

  function can(action) {
    return Boolean(state.session && state.session.can && state.session.can[action]);
  }

  function cookie(name) {
    for (const part of document.cookie.split(";")) {
      const [k, ...v] = part.trim().split("=");
      if (k === name) return decodeURIComponent(v.join("="));
    }
    return "";
  }

  // -- the API -------------------------------------------------------------------

  async function api(method, path, body) {
    const headers = { "Accept": "application/json" };
    if (method !== "GET") {
      headers["X-Gpuwarden-CSRF"] = (state.session && state.session.csrf) || cookie("gw_csrf");
    }
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method, headers, credentials: "same-origin", cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    let doc = null;
    try { doc = await response.json(); } catch (e) { doc = null; }
    if (response.status === 401) { signedOut(doc && doc.error); throw new Error("signed out"); }
    if (!response.ok) throw new Error((doc && doc.error) || method + " " + path + ": " + response.status);
    return doc;
  }

  function notice(text) {
    const n = $("notice");
    n.textContent = text || "";
    n.hidden = !text;
  }

  // -- signing in and out --------------------------------------------------------

  function signedOut(why) {
    state.session = null;
    stopEvents();
    if (state.timer) clearTimeout(state.timer);
    $("main").hidden = true;
    $("signout").hidden = true;
    $("who").textContent = "";
    $("signin").hidden = false;
    $("live").textContent = "signed out";
    $("live").classList.remove("on");
    if (why && !/^no token/.test(why)) $("signin-error").textContent = why;
  }

  async function signIn(event) {
    event.preventDefault();
    $("signin-error").textContent = "";
    const token = $("token").value.trim();
    try {
      const response = await fetch("/v1/session", {
        method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "Accept": "application/json" },
        body: JSON.stringify({ token }),
      });
      const doc = await response.json();
      if (!response.ok) throw new Error(doc.error || "sign-in refused");
      $("token").value = "";
      start(doc);
    } catch (e) {
      $("signin-error").textContent = e.message;
    }
  }

  async function signOut() {
    try { await api("DELETE", "/v1/session"); } catch (e) { /* signed out either way */ }
    signedOut("");
  }

  function start(session) {
    state.session = session;
    $("signin").hidden = true;
    $("main").hidden = false;
    $("signout").hidden = session.via !== "cookie";
    $("who").textContent = session.name + " (" + session.role + ")" +
      (session.own_jobs_only ? ": your jobs only" : "");
    document.body.dataset.role = session.role;
    startEvents();
    refresh(true);
  }

  // -- live updates: the event stream, and polling -------------------------------

  function setLive(on) {
    state.live = on;
    const badge = $("live");
    badge.textContent = on ? "live" : "polling every " + POLL_MS / 1000 + " s";
    badge.classList.toggle("on", on);
  }

  function startEvents() {
    if (state.source || !state.session) return;
    if (!window.EventSource) { setLive(false); return; }  // an old browser: polling only
    let source;
    try {
      source = new EventSource("/v1/events", { withCredentials: true });
    } catch (e) {
      setLive(false);
      return;
    }
    setLive(false);  // until it opens
    state.source = source;
    source.onopen = () => setLive(true);
    source.onerror = () => {
      if (source.readyState === EventSource.CLOSED) {  // refused (or no such route): poll
        stopEvents();
        setTimeout(startEvents, EVENTS_RETRY_MS);
      }
      setLive(false);
    };
    const soon = () => {
      state.lastEvent = Date.now();
      if (state.debounce) return;
      // a burst of events makes one refresh, at most two a second
      state.debounce = setTimeout(() => { state.debounce = null; refresh(false); }, 500);
    };
    for (const kind of EVENT_KINDS) source.addEventListener(kind, soon);
  }

  function stopEvents() {
    if (state.source) state.source.close();
    state.source = null;
    setLive(false);
  }

  function schedule() {
    if (state.timer) clearTimeout(state.timer);
    // just after an event, look again soon: what it tells of may be published a
    // moment after it (a broker's status follows its events)
    const eventful = Date.now() - (state.lastEvent || 0) < 3000;
    const wait = document.hidden ? POLL_HIDDEN_MS : state.live && !eventful ? POLL_LIVE_MS : POLL_MS;
    state.timer = setTimeout(() => refresh(false), wait);
  }

  async function refresh(all) {
    if (!state.session) return;
    const now = Date.now();
    try {
      state.overview = await api("GET", "/v1/dashboard/overview");
      renderOverview(state.overview);
      if (all || now - state.lastHistory >= HISTORY_MS) {
        state.lastHistory = now;
        state.history = await api("GET", "/v1/dashboard/history");
        renderTimeline(state.history);
      }
      if (all || now - state.lastStats >= STATS_MS) {
        state.lastStats = now;
        state.stats = await api("GET", "/v1/dashboard/stats");
        renderStats(state.stats);
      }
      $("foot").textContent = "updated " + new Date().toLocaleTimeString();
      state.refreshes = (state.refreshes || 0) + 1;
      document.body.dataset.refreshes = String(state.refreshes);  // tests wait on it
      if (!state.actionError) notice("");
    } catch (e) {
      if (!state.session) return;
      notice("could not refresh: " + e.message);
    }
    schedule();
  }

  // -- actions -------------------------------------------------------------------

  // a button that asks once more before it acts; the page is redrawn every few
  // seconds, so whether it has been asked is kept by key, not in the button
  const ARM_MS = 4000;
  state.armed = {};

  function actionButton(key, label, title, run) {
    const button = el("button", { type: "button", class: "danger", title, "data-action": key });
    const look = () => {
      const armed = (state.armed[key] || 0) > Date.now();
      button.textContent = armed ? "confirm " + label : label;
      button.classList.toggle("confirm", armed);
    };
    look();
    button.addEventListener("click", async () => {
      if (!((state.armed[key] || 0) > Date.now())) {
        state.armed[key] = Date.now() + ARM_MS;
        look();
        setTimeout(look, ARM_MS + 50);
        return;
      }
      delete state.armed[key];
      button.disabled = true;
      try {
        await run();
        state.actionError = "";
        notice(label + ": done");
      } catch (e) {
        state.actionError = e.message;
        notice(label + " refused: " + e.message);
        setTimeout(() => { state.actionError = ""; }, 8000);
      }
      refresh(false);
    });
    return button;
  }

  function cancelButton(job) {
    if (!can("job.cancel") || !job.id) return null;
    return actionButton("cancel:" + job.id, "cancel", "cancel job " + job.id, () =>
      api("POST", "/v1/jobs/" + encodeURIComponent(job.id) + "/cancel"));
  }

  // -- drawing -------------------------------------------------------------------

  function renderOverview(doc) {
    renderBanners(doc.nodes);
    renderGpus(doc.nodes);
    renderRunning(doc.running);
    renderQueued(doc.queued);
    renderLeases(doc.leases);
    renderWarm(doc.nodes);
    renderFailures(doc.failures);
    renderCluster(doc.cluster);
  }

  function renderBanners(nodes) {
    const banners = [];
    for (const n of nodes) {
      if (n.probe_error) {
        banners.push(el("div", { class: "banner degraded", "data-node": n.node },
          el("span", { class: "text" }, "node " + n.node + ": the GPU probe failed: " + n.probe_error)));
      }
      if (n.stopped) {
        banners.push(el("div", { class: "banner degraded", "data-node": n.node },
          el("span", { class: "text" }, "node " + n.node + ": its broker has stopped")));
      }
      for (const g of n.gpus) {
        if (!g.degraded) continue;
        const clear = g.fault && can("gpu.clear")
          ? actionButton("clear:" + g.uuid, "clear fault", "resume VRAM admission on " + g.uuid, () =>
            api("POST", "/v1/gpus/" + encodeURIComponent(g.uuid) + "/clear",
              { reason: "cleared from the dashboard" }))
          : null;
        banners.push(el("div", {
          class: "banner " + (g.fault ? "fault" : "degraded"), "data-gpu": g.uuid,
        },
        el("strong", {}, g.fault ? "GPU fault" : "GPU degraded"),
        el("span", { class: "text" }, (g.name || "GPU") + " " + g.uuid + " on " + n.node + ": " + g.degraded),
        clear));
      }
    }
    fill("banners", banners);
  }

  function sensorsText(s) {
    const parts = [];
    if (s.util_pct != null) parts.push("util " + Math.round(s.util_pct) + " %");
    if (s.temp_c != null) parts.push(Math.round(s.temp_c) + " °C");
    if (s.power_w != null) parts.push(Math.round(s.power_w) + " W");
    return parts.join(" · ");
  }

  function gpuBar(g) {
    const total = Number(g.total_bytes) || 0;
    const segs = [];
    const holders = [];
    let at = 0;
    const add = (cls, bytes, label, data) => {
      if (!(bytes > 0)) return;
      segs.push(el("div", {
        class: "seg " + cls, title: label + ": " + gib(bytes),
        style: { left: pct(at, total) + "%", width: pct(bytes, total) + "%" }, ...data,
      }));
      holders.push(el("li", {}, el("span", { class: "sw sw-" + cls }), label + " " + gib(bytes)));
      at += bytes;
    };
    for (const h of g.holdings) {
      const label = h.kind === "warm" ? "warm " + h.type
        : h.kind === "ledger" ? "ledger (jobs and warm servers)" : (h.job || h.holder) + " (" + h.type + ")";
      add(h.kind === "warm" ? "warm" : "job", h.bytes, label, { "data-job": h.job || null, "data-holder": h.holder });
    }
    for (const r of g.runtimes) add("runtime", r.bytes, "runtime " + r.name, {});
    add("foreign", g.foreign_bytes, "foreign", {});
    const reserve = Number(g.reserve_bytes) || 0;
    if (reserve > 0) {
      segs.push(el("div", {
        class: "seg reserve", title: "reserve: " + gib(reserve),
        style: { left: pct(total - reserve, total) + "%", width: pct(reserve, total) + "%" },
      }));
    }
    segs.push(el("div", {
      class: "marker", title: "the device reads " + gib(g.used_bytes) + " used",
      style: { left: "calc(" + pct(g.used_bytes, total) + "% - 1px)" },
    }));
    return { bar: el("div", { class: "bar", "data-gpu": g.uuid }, segs), holders };
  }

  function renderGpus(nodes) {
    const out = [];
    let count = 0;
    for (const n of nodes) {
      out.push(el("div", { class: "node-head" }, el("strong", {}, n.node),
        el("span", { class: "mute" }, "probe " + (n.probe || "?") + ", published " + dur(n.age_s) + " ago" +
          (n.accepting ? "" : ", not accepting"))));
      for (const g of n.gpus) {
        count += 1;
        const { bar, holders } = gpuBar(g);
        out.push(el("div", { class: "gpu", "data-gpu": g.uuid },
          el("div", { class: "gpu-title" }, el("strong", {}, g.name || "GPU"),
            el("span", { class: "mono mute" }, g.uuid),
            el("span", { class: "mute" }, "ledger " + gib(g.ledger_bytes) + " · device " + gib(g.used_bytes) +
              " of " + gib(g.total_bytes) + " · free to admit " + gib(g.free_bytes)),
            g.sensors ? el("span", { class: "mute sensors" }, sensorsText(g.sensors)) : null),
          bar,
          holders.length ? el("ul", { class: "holders" }, holders) : el("div", { class: "empty" }, "nothing held")));
      }
    }
    if (!nodes.length) out.push(el("p", { class: "empty" }, "no broker has published its status yet"));
    fill("gpus", out);
    $("gpus-note").textContent = count ? count + " on " + nodes.length + " node" + (nodes.length === 1 ? "" : "s") : "";
  }

  function renderRunning(rows) {
    $("running-count").textContent = rows.length ? "(" + rows.length + ")" : "";
    if (!rows.length) { fill("running", el("p", { class: "empty" }, "nothing running")); return; }
    fill("running", el("ul", { class: "rows" }, rows.map((r) => {
      const of = r.progress_of === "expected" ? "of about " + dur(r.expected_s)
        : r.progress_of === "timeout" ? "of its " + dur(r.timeout_s) + " timeout" : "";
      return el("li", { "data-job": r.id, class: "job-running" },
        el("div", { class: "row-head" }, el("span", { class: "id mono" }, r.id),
          el("span", { class: "grow mute" }, r.type + (r.gpu ? " on " + r.gpu : "") + (r.node ? " (" + r.node + ")" : "")),
          r.cancel_requested ? el("span", { class: "mute" }, "stopping") : cancelButton(r)),
        el("div", { class: "reason" }, "running " + dur(r.elapsed_s) + " " + of + ", attempt " + (r.attempt || "?")),
        r.progress !== null ? el("div", { class: "progress" }, el("div", { style: { width: 100 * r.progress + "%" } })) : null);
    })));
  }

  function renderQueued(rows) {
    $("queued-count").textContent = rows.length ? "(" + rows.length + ")" : "";
    if (!rows.length) { fill("queued", el("p", { class: "empty" }, "the queue is empty")); return; }
    fill("queued", el("ul", { class: "rows" }, rows.map((q) =>
      el("li", { "data-job": q.id, class: "job-queued" },
        el("div", { class: "row-head" }, el("span", { class: "id mono" }, q.id),
          el("span", { class: "grow mute" }, q.type + ", priority " + q.priority + ", waiting " + dur(q.waited_s)),
          cancelButton(q)),
        el("div", { class: "reason" }, q.reason)))));
  }

  function endLeaseButton(x) {
    if (!can("lease.end") || !x.id) return null;
    return actionButton("end:" + x.id, "end", "end lease " + x.id + ": its app loses the room", () =>
      api("DELETE", "/v1/leases/" + encodeURIComponent(x.id)));
  }

  // VRAM leases (room on a GPU for an app that is not a job): who holds how much
  // where, and how long before the ttl runs out unless its holder renews it
  function renderLeases(doc) {
    const rows = (doc && doc.rows) || [];
    const t = (doc && doc.totals) || { granted: 0, waiting: 0, held_bytes: {} };
    const held = Object.entries(t.held_bytes || {}).map(([g, b]) => g + " " + gib(b)).join(", ");
    $("leases-count").textContent = rows.length
      ? "(" + t.granted + " granted, " + t.waiting + " waiting" + (held ? "; held: " + held : "") + ")" : "";
    if (!rows.length) { fill("leases", el("p", { class: "empty" }, "no VRAM lease")); return; }
    fill("leases", el("ul", { class: "rows" }, rows.map((x) => {
      const who = x.holder && x.holder !== x.owner ? x.holder + " (" + x.owner + ")" : x.owner || x.holder;
      const where = x.gpu ? (x.state === "granted" ? " on " : " pinned to ") + x.gpu : "";
      const left = x.state !== "granted" ? "waiting " + dur(x.waited_s) + (x.reason ? ": " + x.reason : "")
        : x.ttl_left_s === null ? "granted"
          : "ttl runs out in " + dur(x.ttl_left_s) + " unless renewed (ttl " + dur(x.ttl_s) + ")";
      return el("li", { "data-lease": x.id, class: "lease lease-" + x.state },
        el("div", { class: "row-head" }, el("span", { class: "id mono" }, x.id),
          el("span", { class: "grow mute" }, gib(x.vram_bytes) + where + ", " + who),
          el("span", { class: "lease-state" }, x.state), endLeaseButton(x)),
        el("div", { class: "reason" }, left));
    })));
  }

  function renderWarm(nodes) {
    const rows = [];
    for (const n of nodes) {
      for (const w of n.warm) {
        const grace = w.keep_warm ? "kept warm" : w.grace_left_s !== null
          ? "idle " + dur(w.idle_s) + ", stops in " + dur(w.grace_left_s) : w.state;
        const where = w.gpu ? " on " + w.gpu : " on " + n.node;
        const detail = w.footprint_bytes === null || w.footprint_bytes === undefined ? null
          : el("div", { class: "reason" }, gib(w.footprint_bytes) + ", " + (w.jobs_served || 0) + " jobs served, " + grace);
        rows.push(el("li", {},
          el("div", { class: "row-head" }, el("span", { class: "id" }, w.type),
            el("span", { class: "grow mute" }, w.state + where)),
          detail));
      }
    }
    fill("warm", rows.length ? el("ul", { class: "rows" }, rows) : el("p", { class: "empty" }, "no warm server"));
  }

  function renderFailures(rows) {
    if (!rows.length) { fill("failures", el("p", { class: "empty" }, "no failed job")); return; }
    fill("failures", el("ul", { class: "rows" }, rows.map((f) =>
      el("li", { "data-job": f.id },
        el("div", { class: "row-head" }, el("span", { class: "id mono" }, f.id),
          el("span", { class: "grow mute" }, f.type + " at " + clock(f.ended_at))),
        el("div", { class: "reason" }, f.reason)))));
  }

  function renderCluster(nodes) {
    $("cluster-card").hidden = !nodes;
    if (!nodes) return;
    const head = el("tr", {}, el("th", {}, "node"), el("th", {}, "state"), el("th", {}, "heard from"),
      el("th", {}, "GPUs"), el("th", { class: "num" }, "running"), can("node.drain") ? el("th", {}, "") : null);
    const body = nodes.map((n) => {
      const gpus = (n.gpus || []).map((g) => (g.name || g.uuid) + " " + gib(g.free_bytes) + " free").join("; ");
      let act = null;
      if (can("node.drain") && n.state === "active") {
        act = actionButton("drain:" + n.name, "drain", "no new work for " + n.name, () =>
          api("POST", "/v1/nodes/" + encodeURIComponent(n.name) + "/drain"));
      } else if (can("node.resume") && n.state === "draining") {
        act = actionButton("resume:" + n.name, "resume", "take new work on " + n.name, () =>
          api("POST", "/v1/nodes/" + encodeURIComponent(n.name) + "/resume"));
      }
      return el("tr", { "data-node": n.name },
        el("td", {}, n.name), el("td", { class: "state-" + n.state }, n.state + (n.condition ? ": " + n.condition : "")),
        el("td", {}, n.seen_s_ago === null ? "never" : dur(n.seen_s_ago) + " ago"),
        el("td", {}, gpus || "none"), el("td", { class: "num" }, n.running),
        can("node.drain") ? el("td", {}, act) : null);
    });
    fill("cluster", el("table", {}, el("thead", {}, head), el("tbody", {}, body)));
  }

  function renderTimeline(doc) {
    const figures = [];
    const W = 300;
    const H = 80;
    for (const g of doc.gpus) {
      const total = g.total_bytes || 1;
      // the last hour, or less while this API has less: from its first sample (a minute at least)
      const t1 = doc.now;
      const t0 = Math.max(t1 - doc.keep_s, Math.min(doc.since || t1, t1 - 60));
      const x = (ts) => ((ts - t0) / (t1 - t0)) * W;
      const y = (b) => H - (Math.min(b, total) / total) * (H - 4) - 2;
      const line = (i) => g.samples.map((s) => x(s[0]).toFixed(1) + "," + y(s[i]).toFixed(1)).join(" ");
      const chart = svg("svg", { viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "none", role: "img" });
      chart.append(svg("polyline", { class: "line-used", points: line(1) }));
      chart.append(svg("polyline", { class: "line-ledger", points: line(2) }));
      const last = g.samples[g.samples.length - 1];
      if (last) {  // the latest reading as a dot: one sample is visible too
        chart.append(svg("circle", { class: "dot-used", cx: x(last[0]), cy: y(last[1]), r: 2.5 }));
        chart.append(svg("circle", { class: "dot-ledger", cx: x(last[0]), cy: y(last[2]), r: 2.5 }));
      }
      figures.push(el("figure", { "data-gpu": g.uuid }, chart,
        el("figcaption", {}, (g.name || "GPU") + " " + g.uuid + " (" + g.node + "): ",
          el("span", { style: { color: "var(--device)" } }, "device"), " and ",
          el("span", { style: { color: "var(--job)" } }, "ledger"), ", of " + gib(total))));
    }
    fill("timeline", figures.length ? figures : el("p", { class: "empty" }, "no samples yet"));
    $("timeline-note").textContent = doc.since
      ? "(this API has data from " + clock(doc.since) + ", " + dur(doc.now - doc.since) + " back; a sample every " + doc.every_s + " s)"
      : "(no data yet: this API samples every " + doc.every_s + " s from its start)";
  }

  function hbars(rows, max, cls) {
    return el("div", { class: "hbar" }, rows.flatMap(([label, value, shown]) => [
      el("span", {}, label),
      el("div", { class: "track" }, el("div", { class: "fill " + (cls || ""), style: { width: pct(value, max) + "%" } })),
      el("span", { class: "num" }, shown),
    ]));
  }

  function renderStats(doc) {
    const w = doc.waits;
    const labels = w.edges_s.map((e, i) => (i + 1 < w.edges_s.length ? "< " + dur(w.edges_s[i + 1]) : "≥ " + dur(e)));
    const most = Math.max(1, ...w.counts);
    $("waits-note").textContent = "(" + w.attempts + " attempts, last " + dur(w.window_s) + ")";
    fill("waits", hbars(w.counts.map((c, i) => [labels[i], c, String(c)]), most));

    if (!doc.footprints.length) fill("footprints", el("p", { class: "empty" }, "no VRAM job type"));
    else {
      fill("footprints", el("table", {},
        el("thead", {}, el("tr", {}, el("th", {}, "type"), el("th", { class: "num" }, "declared"), el("th", { class: "num" }, "measured"))),
        el("tbody", {}, doc.footprints.slice(0, FOOTPRINTS_SHOWN).map((f) => el("tr", {},
          el("td", { class: "mono" }, f.type), el("td", { class: "num" }, gib(f.declared_bytes)),
          el("td", { class: "num" }, f.measured_bytes === null ? "not yet" : gib(f.measured_bytes) +
            (f.measured_bytes > f.declared_bytes ? " ▲" : "")))))),
        doc.footprints.length > FOOTPRINTS_SHOWN
          ? el("p", { class: "mute" }, (doc.footprints.length - FOOTPRINTS_SHOWN) + " more types not shown (measured and recently run types come first)")
          : null);
    }

    const parts = [];
    for (const [window, rows] of Object.entries(doc.gpu_hours)) {
      const most2 = Math.max(0.0001, ...rows.map((r) => r.hours));
      parts.push(el("div", { class: "mute" }, "last " + window));
      parts.push(rows.length ? hbars(rows.map((r) => [r.name, r.hours, r.hours < 0.1 ? dur(r.hours * 3600) : r.hours.toFixed(1) + " h"]), most2, "measured")
        : el("p", { class: "empty" }, "no GPU time"));
    }
    fill("hours", parts);
  }

  // -- start ---------------------------------------------------------------------

  async function boot() {
    $("signin-form").addEventListener("submit", signIn);
    $("signout").addEventListener("click", signOut);
    document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(false); });
    try {
      const response = await fetch("/v1/session", { credentials: "same-origin", cache: "no-store" });
      if (response.ok) start(await response.json());
      else signedOut("");
    } catch (e) {
      signedOut("the API does not answer: " + e.message);
    }
  }

  document.addEventListener("DOMContentLoaded", boot);
})();
