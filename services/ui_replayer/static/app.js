// The ui-replayer's live tail: builds entries with textContent only, mirroring page.render_entry.
// Never innerHTML with content.
"use strict";
// The fleet overview's live rows: builds cells with textContent only, mirroring page.fleet_row.
(function () {
  var body = document.body;
  if (body.dataset.fleet !== "1" || !window.EventSource) { return; }
  var tbody = document.getElementById("fleet-rows");
  var status = document.getElementById("live-status");
  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) { node.className = cls; }
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    return node;
  }
  function num(v) { return v === null || v === undefined ? el("span", "muted", "\u2014") : document.createTextNode(v.toLocaleString("en-US")); }
  function when(ms) {
    if (!ms) { return ""; }
    return new Date(ms).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
  }
  function href(id) { return "/sessions/" + encodeURIComponent(id); }
  function cell(tr, cls, child) { var td = el("td", cls); if (child) { td.appendChild(child); } tr.appendChild(td); return td; }
  function row(r) {
    var tr = el("tr", r.open_turn ? "open" : "closed");
    tr.dataset.id = r.id;
    var first = cell(tr, null, null);
    var link = el("a", "session-link", r.id); link.href = href(r.id); first.appendChild(link);
    first.appendChild(el("div", "title", r.title || ""));
    var badge = r.open_turn ? el("span", "badge open-turn", "turn " + r.open_turn + " open") : el("span", "badge closed", "closed");
    if (r.error) { badge = el("span", "badge corrupt", r.error.split(":")[0]); badge.title = r.error; }
    cell(tr, "state", badge);
    cell(tr, "holder", r.lease_holder ? document.createTextNode(r.lease_holder) : el("span", "muted", "\u2014"));
    cell(tr, "num events", num(r.events));
    cell(tr, "when", document.createTextNode(when(r.last_activity || r.created_at)));
    cell(tr, "num tokens", num(r.tokens));
    cell(tr, "num findings", r.findings ? el("span", "badge error", r.findings) : num(r.findings));
    var parent = null;
    if (r.parent) { parent = el("a", null, r.parent); parent.href = href(r.parent); }
    cell(tr, "parent", parent);
    cell(tr, "cwd", document.createTextNode(r.cwd || ""));
    return tr;
  }
  function onRows(msg) {
    var rows = JSON.parse(msg.data);
    rows.forEach(function (r) {
      var old = null;
      tbody.querySelectorAll(":scope > tr").forEach(function (tr) { if (tr.dataset.id === r.id) { old = tr; } });
      var fresh = row(r);
      fresh.classList.add("changed");
      if (old) { old.replaceWith(fresh); }
      if (body.dataset.prepend === "1") {
        tbody.insertBefore(fresh, tbody.firstChild);  // most recent activity first
        var table = tbody.closest("table");
        if (table) { table.classList.remove("hidden"); }
        var empty = document.querySelector("p.empty");
        if (empty) { empty.remove(); }
      }
    });
  }
  var source = new EventSource("/events");
  source.addEventListener("rows", onRows);
  source.onopen = function () { if (status) { status.className = "live-status on"; } };
  source.onerror = function () { if (status) { status.className = "live-status off"; } };
})();
(function () {
  var body = document.body;
  var sid = body.dataset.session;
  if (!sid || body.dataset.live !== "1" || !window.EventSource) { return; }
  var main = document.getElementById("transcript");
  var status = document.getElementById("live-status");
  var STATE = {streaming: "streaming\u2026", finished: "response complete", failed: "response failed",
    retried: "response failed, retried", cut: "response cut off (no message was written)"};
  var OUTCOME = {completed: "completed", aborted: "aborted", blocked: "blocked", error: "ended with an error",
    "max-tokens": "stopped at the token limit", interrupted: "interrupted by a crash"};
  var SYNTHETIC = {TOOL_OUTCOME_UNKNOWN: "synthetic result: the turn was interrupted after the call was recorded; " +
    "its outcome is unknown", TOOL_NOT_STARTED: "synthetic result: the turn was interrupted before the tool started"};
  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) { node.className = cls; }
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    return node;
  }
  function token(s) { return String(s || "").replace(/[^A-Za-z0-9_-]/g, "_"); }
  function block(b, index) {
    var node, head;
    var kind = b.type;
    if (kind === "reasoning") {
      node = el("details", "block reasoning");
      node.appendChild(el("summary", null, "thinking"));
      node.appendChild(el("div", "body", b.text || ""));
    } else if (kind === "tool-call") {
      node = el("div", "block tool-call");
      head = el("div", "tool-head", "tool call ");
      head.appendChild(el("b", "tool-name", b.name || ""));
      head.appendChild(document.createTextNode(" "));
      head.appendChild(el("code", "call-id", b.id || ""));
      node.appendChild(head);
      node.appendChild(el("pre", "body args", b.text || ""));
    } else if (kind === "tool-result") {
      node = el("div", "block tool-result" + (b.is_error ? " error" : ""));
      head = el("div", "tool-head", "result of ");
      head.appendChild(el("code", "call-id", b.tool_call_id || ""));
      if (b.is_error) { head.appendChild(document.createTextNode(" ")); head.appendChild(el("span", "badge error", "error")); }
      node.appendChild(head);
      node.appendChild(el("pre", "body", b.text || ""));
    } else if (kind === "image") {
      node = el("div", "block image");
      node.appendChild(el("div", "body", "[image " + (b.attachment || "?") + "]"));
    } else {
      node = el("div", "block " + (kind === "text" ? "text" : "other"));
      node.appendChild(el("div", "body", b.text || ""));
    }
    if (index !== undefined) { node.dataset.index = String(index); }
    return node;
  }
  function blocks(list, indexed) {
    var box = el("div", "blocks");
    (list || []).forEach(function (b, i) { box.appendChild(block(b, indexed ? i : undefined)); });
    return box;
  }
  function shell(entry, tag, cls) {
    var node = el(tag, "entry " + cls);
    node.id = entry.key;
    node.dataset.key = entry.key;
    node.dataset.seq = String(entry.seq);
    return node;
  }
  function meta(who, extra, seq) {
    var m = el("div", "meta");
    m.appendChild(el("span", "who", who));
    extra.forEach(function (x) { m.appendChild(document.createTextNode(" ")); m.appendChild(x); });
    m.appendChild(el("span", "seq", "#" + seq));
    return m;
  }
  function render(e) {
    var node, details;
    switch (e.kind) {
    case "turn-start":
      return shell(e, "div", "turn-start").appendChild(document.createTextNode("Turn " + e.turn)).parentNode;
    case "turn-end":
      node = shell(e, "div", "turn-end outcome-" + token(e.outcome));
      node.appendChild(document.createTextNode("Turn " + e.turn + " " + (OUTCOME[e.outcome] || e.outcome)));
      if (e.detail) { node.appendChild(document.createTextNode(" ")); node.appendChild(el("span", "detail", "\u2014 " + e.detail)); }
      return node;
    case "seed":
      return shell(e, "div", "seed").appendChild(document.createTextNode(
        "inherited history ends here (events 0-" + (e.seq - 1) + " came from before)")).parentNode;
    case "note":
      return shell(e, "div", "note").appendChild(document.createTextNode(e.text || "")).parentNode;
    case "compaction":
      node = shell(e, "div", "compaction");
      node.appendChild(el("span", "marker", (e.summarised ? "summarised" : "replaced") + " for the model: events " +
        e.first + "-" + e.through));
      details = el("details", "summary");
      details.appendChild(el("summary", null, "what the model sees instead"));
      details.appendChild(blocks(e.summary, false));
      node.appendChild(details);
      return node;
    case "stream":
      node = shell(e, "article", "msg role-assistant stream state-" + token(e.state));
      node.appendChild(meta("assistant", [el("span", "state", STATE[e.state] || e.state)].concat(
        e.error ? [el("span", "error-text", e.error)] : []), e.seq));
      node.appendChild(blocks(e.blocks, true));
      return node;
    default:
      var badges = [];
      if (e.interrupted) { badges.push(el("span", "badge interrupted", "interrupted: partial response")); }
      if (e.synthetic) { badges.push(el("span", "badge synthetic", SYNTHETIC[e.synthetic] || e.synthetic)); }
      else if (e.error) { badges.push(el("span", "badge error", e.error)); }
      var who = e.event_type === "tool/result" ? "tool" : (e.source === "plugin" ? "context from " + (e.plugin || "a plugin")
        : (e.role === "assistant" && e.model ? "assistant \u00b7 " + e.model : e.role));
      node = shell(e, "article", "msg role-" + token(e.role) + " src-" + token(e.source) + (e.synthetic ? " synthetic" : ""));
      node.appendChild(meta(who, badges, e.seq));
      if (e.source === "plugin") {
        details = el("details");
        details.appendChild(el("summary", null, "show"));
        details.appendChild(blocks(e.blocks, false));
        node.appendChild(details);
      } else {
        node.appendChild(blocks(e.blocks, false));
      }
      return node;
    }
  }
  function nearBottom() { return window.innerHeight + window.scrollY >= document.body.scrollHeight - 80; }
  function place(node, replaces) {
    var old = document.getElementById(node.id) || (replaces ? document.getElementById(replaces) : null);
    if (old) { old.replaceWith(node); } else { main.appendChild(node); }
  }
  function onEntry(msg) {
    var stick = nearBottom();
    var entry = JSON.parse(msg.data);
    place(render(entry), entry.replaces);
    if (entry.replaces && entry.key !== entry.replaces) {
      var stale = document.getElementById(entry.replaces);
      if (stale) { stale.remove(); }
    }
    body.dataset.nextSeq = msg.lastEventId || body.dataset.nextSeq;
    if (stick) { window.scrollTo(0, document.body.scrollHeight); }
  }
  function onDelta(msg) {
    var stick = nearBottom();
    var d = JSON.parse(msg.data);
    var entry = document.getElementById(d.key);
    if (!entry) { return; }
    var box = entry.querySelector(".blocks");
    var target = null;
    box.querySelectorAll(":scope > .block").forEach(function (n) { if (n.dataset.index === String(d.index)) { target = n; } });
    if (!target) { target = block({type: d.block, text: "", name: d.name || "", id: d.id || ""}, d.index); box.appendChild(target); }
    var text = target.querySelector(".body");
    if (text) { text.textContent += d.text; }
    if (d.name) {
      var name = target.querySelector(".tool-name");
      if (name && !name.textContent) { name.textContent = d.name; }
    }
    if (d.id) { var callId = target.querySelector(".call-id"); if (callId) { callId.textContent = d.id; } }
    body.dataset.nextSeq = msg.lastEventId || body.dataset.nextSeq;
    if (stick) { window.scrollTo(0, document.body.scrollHeight); }
  }
  var source = new EventSource("/sessions/" + encodeURIComponent(sid) + "/events?from_seq=" +
    encodeURIComponent(body.dataset.nextSeq || "0"));
  source.addEventListener("entry", onEntry);
  source.addEventListener("delta", onDelta);
  source.onopen = function () { if (status) { status.className = "live-status on"; } };
  source.onerror = function () { if (status) { status.className = "live-status off"; } };
})();
