"""The web UI: one static page (inline CSS and JS, no build step) served at ``/`` with ``--serve webui``.

It chats through ``/v1/chat/completions`` (streaming; a Stop button aborts the fetch, which cancels the
generation on the server), shows reasoning in a collapsible block, and polls ``/metrics`` for a live
layer x expert heatmap of the share of tokens each expert received (over the last poll interval while
tokens flow, else since start). With ``--api-key`` the page asks for the key and keeps it in the
browser's localStorage. ``/?q=TEXT`` sends TEXT on load (used by the headless-browser test).
"""
from __future__ import annotations

import html

__all__ = ["page"]

_PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dynamoe · __MODEL_HTML__</title>
<style>
:root { --bg:#0f1115; --panel:#171a21; --fg:#e6e6e6; --dim:#8a90a0; --acc:#6aa9ff; --user:#23324d; --bot:#1d2028; }
* { box-sizing: border-box; }
body { margin:0; font:15px/1.5 system-ui, sans-serif; background:var(--bg); color:var(--fg); display:flex; height:100vh; }
main { flex:1; display:flex; flex-direction:column; min-width:0; }
header { padding:10px 16px; border-bottom:1px solid #2a2f3a; display:flex; gap:12px; align-items:center; flex-wrap:wrap; }
header b { color:var(--acc); }
header label { color:var(--dim); font-size:13px; }
header input { width:70px; background:var(--panel); color:var(--fg); border:1px solid #2a2f3a; border-radius:4px; padding:2px 4px; }
#log { flex:1; overflow-y:auto; padding:16px; }
.msg { max-width:900px; margin:0 auto 12px; padding:10px 14px; border-radius:8px; white-space:pre-wrap; word-wrap:break-word; }
.user { background:var(--user); }
.assistant { background:var(--bot); }
.error { background:#4d2323; }
details.think { color:var(--dim); font-size:13px; margin-bottom:6px; white-space:pre-wrap; }
details.think summary { cursor:pointer; }
form { display:flex; gap:8px; padding:12px 16px; border-top:1px solid #2a2f3a; }
textarea { flex:1; resize:vertical; min-height:44px; background:var(--panel); color:var(--fg); border:1px solid #2a2f3a; border-radius:6px; padding:8px; font:inherit; }
button { background:var(--acc); color:#000; border:0; border-radius:6px; padding:0 16px; font-weight:600; cursor:pointer; }
button:disabled { opacity:.4; cursor:default; }
#stop { background:#ff7a6a; }
aside { width:340px; border-left:1px solid #2a2f3a; padding:12px; overflow-y:auto; background:var(--panel); font-size:13px; }
aside h3 { margin:0 0 8px; font-size:14px; }
#stats { color:var(--dim); margin-bottom:10px; }
#heat { display:grid; gap:1px; }
#heat div { height:14px; border-radius:2px; }
#heat .lbl { color:var(--dim); font-size:10px; line-height:14px; text-align:right; padding-right:3px; }
#legend { color:var(--dim); margin-top:8px; }
#keybox { display:none; }
</style>
</head>
<body data-model="__MODEL_HTML__">
<main>
  <header>
    <span>dynamoe · <b id="model">__MODEL_HTML__</b></span>
    <label>temperature <input id="temp" type="number" step="0.1" min="0" value="0.7"></label>
    <label>max tokens <input id="maxtok" type="number" min="1" value="512"></label>
    <label><input id="think" type="checkbox" checked style="width:auto"> thinking</label>
    <label id="keybox">API key <input id="key" type="password" style="width:160px"></label>
    <button id="clear" type="button" style="background:#444;color:#eee">New chat</button>
  </header>
  <div id="log"></div>
  <form id="form">
    <textarea id="input" placeholder="Message (Enter to send, Shift+Enter for a new line)"></textarea>
    <button id="send" type="submit">Send</button>
    <button id="stop" type="button" disabled>Stop</button>
  </form>
</main>
<aside>
  <h3>Expert load</h3>
  <div id="stats">waiting for /metrics…</div>
  <div id="heat"></div>
  <div id="legend">rows: MoE layers · columns: experts · colour: share of the layer's tokens
  (bright = above uniform)</div>
</aside>
<script>
const $ = (id) => document.getElementById(id);
const turns = [];
let controller = null;
const keyInput = $("key");
keyInput.value = localStorage.getItem("dynamoe-key") || "";
if (keyInput.value) $("keybox").style.display = "inline";
keyInput.addEventListener("change", () => localStorage.setItem("dynamoe-key", keyInput.value));

function headers() {
  const h = {"Content-Type": "application/json"};
  if (keyInput.value) h["Authorization"] = "Bearer " + keyInput.value;
  return h;
}
function needKey() { $("keybox").style.display = "inline"; keyInput.focus(); }

function bubble(role, text) {
  const d = document.createElement("div");
  d.className = "msg " + role;
  d.textContent = text || "";
  $("log").appendChild(d);
  $("log").scrollTop = $("log").scrollHeight;
  return d;
}

async function send(text) {
  if (!text.trim() || controller) return;
  turns.push({role: "user", content: text});
  bubble("user", text);
  const box = bubble("assistant", "");
  box.dataset.done = "0";
  let think = null, thinkText = null;
  const body = document.createElement("span");
  box.appendChild(body);
  let content = "", reasoning = "";
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({model: $("model").textContent, messages: turns, stream: true,
        temperature: parseFloat($("temp").value), max_tokens: parseInt($("maxtok").value),
        chat_template_kwargs: {enable_thinking: $("think").checked}})});
    if (res.status === 401) needKey();
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || res.statusText);
    }
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut); buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const delta = (chunk.choices[0] || {}).delta || {};
          const r = delta.reasoning_content || delta.reasoning;
          if (r) {
            if (!think) {
              think = document.createElement("details"); think.className = "think"; think.open = true;
              think.innerHTML = "<summary>Thinking</summary>";
              thinkText = document.createElement("div"); think.appendChild(thinkText);
              box.insertBefore(think, body);
            }
            reasoning += r; thinkText.textContent = reasoning;
          }
          if (delta.content) {
            if (think && think.open && !content) think.open = false;
            content += delta.content; body.textContent = content;
          }
          for (const tc of delta.tool_calls || []) {
            content += "\n[tool call] " + tc.function.name + " " + tc.function.arguments;
            body.textContent = content;
          }
          $("log").scrollTop = $("log").scrollHeight;
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") body.textContent = content + " [stopped]";
    else { box.classList.add("error"); body.textContent = content + "\n[error] " + e.message; }
  } finally {
    turns.push({role: "assistant", content: content});
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
    box.dataset.done = "1";
    document.body.dataset.done = "1";
  }
}

$("form").addEventListener("submit", (e) => { e.preventDefault(); const t = $("input").value; $("input").value = ""; send(t); });
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { if (!controller) { turns.length = 0; $("log").innerHTML = ""; } });

// --- live expert load from /metrics ---
let last = null;
function parseMetrics(text) {
  const load = {}, gauges = {};
  for (const line of text.split("\n")) {
    let m = line.match(/^dynamoe_moe_expert_tokens_total\{layer="(\d+)",expert="(\d+)"\} (\d+)/);
    if (m) { (load[m[1]] = load[m[1]] || [])[+m[2]] = +m[3]; continue; }
    m = line.match(/^(dynamoe_(?:running_sequences|queue_depth|generation_tokens_total)) (\S+)/);
    if (m) gauges[m[1]] = +m[2];
  }
  return {load, gauges};
}
function colour(share, E) {
  const x = Math.min(1, share * E / 2);            // uniform share = 0.5
  const h = 220 - 200 * x, l = 18 + 50 * x;
  return `hsl(${h}, 80%, ${l}%)`;
}
async function poll() {
  try {
    const res = await fetch("/metrics", {headers: headers()});
    if (res.status === 401) { needKey(); return; }
    const {load, gauges} = parseMetrics(await res.text());
    $("stats").textContent = `running ${gauges.dynamoe_running_sequences ?? 0} · queued ${gauges.dynamoe_queue_depth ?? 0}` +
      ` · generated ${gauges.dynamoe_generation_tokens_total ?? 0} tokens`;
    const layers = Object.keys(load).map(Number).sort((a, b) => a - b);
    if (!layers.length) { $("heat").textContent = "no MoE layers reported yet"; return; }
    let live = false;
    const view = {};
    for (const l of layers) {
      const prev = last && last[l];
      const delta = load[l].map((n, e) => n - (prev ? prev[e] || 0 : 0));
      if (prev && delta.some((d) => d > 0)) live = true;
      view[l] = delta;
    }
    const heat = $("heat");
    const E = Math.max(...layers.map((l) => load[l].length));
    heat.style.gridTemplateColumns = `28px repeat(${E}, 1fr)`;
    heat.innerHTML = "";
    for (const l of layers) {
      const row = live ? view[l] : load[l];
      const total = row.reduce((a, b) => a + b, 0) || 1;
      const lbl = document.createElement("div"); lbl.className = "lbl"; lbl.textContent = "L" + l; heat.appendChild(lbl);
      for (let e = 0; e < E; e++) {
        const c = document.createElement("div");
        const share = (row[e] || 0) / total;
        c.style.background = colour(share, E);
        c.title = `layer ${l} expert ${e}: ${(100 * share).toFixed(1)}% (${load[l][e] || 0} tokens total)`;
        heat.appendChild(c);
      }
    }
    $("legend").firstChild.textContent = (live ? "last 2 s" : "since start") +
      " · rows: MoE layers · columns: experts · colour: share of the layer's tokens (bright = above uniform)";
    last = load;
  } catch (e) { $("stats").textContent = "metrics: " + e.message; }
}
poll(); setInterval(poll, 2000);

fetch("/v1/models", {headers: headers()}).then((r) => r.ok ? r.json() : null)
  .then((j) => { if (j && j.data && j.data[0]) $("model").textContent = j.data[0].id; }).catch(() => {});
const q = new URLSearchParams(location.search).get("q");
if (q) send(q);
</script>
</body>
</html>
"""


def page(model_name: str) -> str:
    """The page's HTML for the served model ``model_name``."""
    return _PAGE.replace("__MODEL_HTML__", html.escape(model_name))
