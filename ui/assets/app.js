// lumen's dashboard: one controller's live view of the cluster, fed by
// /ui/api/stream (server-sent events). Plain script, no dependencies.
'use strict';

const WINDOW_MS = 10 * 60 * 1000; // the charts' window
const TIMELINE_MAX = 500;         // entries kept in the timeline
const PLANS_SHOWN = 5;            // recovery plans shown in full

const view = {
  st: null,             // the latest state
  history: [],          // samples, oldest first
  seen: new Set(),      // timeline keys already shown
  marks: [],            // {t, kind} failures and leader changes, for the charts
  migrations: new Map() // request id -> {from, to, since}, from Migration events
};

// --- small helpers ---

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === 'class') el.className = v;
    else if (k.startsWith('data-')) el.setAttribute(k, String(v));
    else el[k] = v;
  }
  for (const kid of kids.flat()) {
    if (kid === undefined || kid === null || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

const $ = (id) => document.getElementById(id);
const strip = (s, prefix) => (s || '').startsWith(prefix) ? s.slice(prefix.length) : (s || '');
const phase = (p) => strip(p, 'WORKER_PHASE_') || 'UNSPECIFIED';
// Incarnations are start times in ns: their last digits tell them apart.
const inc = (n) => { const s = String(n || 0); return '#' + (s.length > 6 ? '…' + s.slice(-6) : s); };
const badge = (text, cls) => h('span', {class: 'badge ' + (cls || text)}, text);

function clock(ms) {
  const d = new Date(ms);
  const p = (n, w = 2) => String(n).padStart(w, '0');
  return `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}.${p(d.getMilliseconds(), 3)}`;
}

function ago(ms, now) {
  const s = Math.max(0, Math.round((now - ms) / 1000));
  if (s < 90) return s + ' s';
  if (s < 5400) return Math.round(s / 60) + ' min';
  return Math.round(s / 3600) + ' h';
}

function bytes(n) {
  n = Number(n || 0);
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let u = 0;
  while (n >= 1024 && u < units.length - 1) { n /= 1024; u++; }
  return (u === 0 ? n : n.toFixed(n < 10 ? 1 : 0)) + ' ' + units[u];
}

function bar(used, total) {
  const f = total > 0 ? Math.min(1, used / total) : 0;
  const b = h('span', {class: 'bar'}, h('i'));
  b.firstChild.style.width = (100 * f).toFixed(1) + '%';
  return b;
}

// --- the stream ---

function connect() {
  const es = new EventSource('api/stream');
  const conn = $('conn');
  es.onopen = () => { conn.dataset.connected = 'true'; conn.textContent = 'live'; };
  es.onerror = () => { conn.dataset.connected = 'false'; conn.textContent = 'disconnected: retrying'; };
  es.addEventListener('state', (e) => onState(JSON.parse(e.data)));
  es.addEventListener('ev', (e) => onEvent(JSON.parse(e.data)));
  es.addEventListener('leader', (e) => onLeader(JSON.parse(e.data)));
  es.addEventListener('reset', () => { view.migrations.clear(); });
}

function onState(st) {
  view.st = st;
  if (st.history) {
    view.history = st.history;
  } else if (st.sample && st.sample.t && (!view.history.length || st.sample.t > view.history[view.history.length - 1].t)) {
    view.history.push(st.sample);
  }
  const cut = st.now - WINDOW_MS;
  while (view.history.length && view.history[0].t < cut) view.history.shift();
  for (const l of st.leaders || []) onLeader(l);
  render();
  document.body.dataset.ready = 'true';
}

// onLeader records a leadership change this replica saw.
function onLeader(l) {
  const key = `leader ${l.t} ${l.leader}`;
  if (view.seen.has(key)) return;
  view.seen.add(key);
  view.marks.push({t: l.t, kind: 'leader'});
  const text = l.leader ? `${l.leader} leads (term ${l.term})` : `no leader (term ${l.term})`;
  addEntry(l.t, 'leader', 'leader', text, [], {'data-leader': l.leader});
  if (view.st) {
    view.st.leader = l.leader;
    renderHeader();
  }
}

// onEvent shows one event of the controller's event stream (protojson of
// lumenpb.Event).
function onEvent(ev) {
  const key = `ev ${ev.index}.${ev.seq || 0}`;
  if (view.seen.has(key)) return;
  view.seen.add(key);
  const t = Number(ev.unixNano || 0) / 1e6;
  if (ev.phaseChanged) {
    const pc = ev.phaseChanged;
    const to = phase(pc.to), from = phase(pc.from);
    const failed = to === 'FAILED';
    if (failed) view.marks.push({t, kind: 'failure'});
    addEntry(t, failed ? 'failure' : 'phase', failed ? 'failure' : to,
      pc.from ? `${pc.workerId} ${inc(pc.incarnation)}: ${from} → ${to}` : `${pc.workerId} ${inc(pc.incarnation)} registered in ${to}`, pc.reason ? [pc.reason] : [],
      {'data-worker': pc.workerId, 'data-incarnation': pc.incarnation || 0, 'data-to': to});
    patchWorker(pc.workerId, {phase: to, incarnation: pc.incarnation || '0', phaseSince: t});
  } else if (ev.recoveryPlan) {
    const rp = ev.recoveryPlan;
    const as = rp.assignments || [];
    const lines = as.slice(0, 12).map(planLine);
    if (as.length > 12) lines.push(`… and ${as.length - 12} more`);
    addEntry(t, 'plan', 'plan', `plan ${rp.id || 0}: ${as.length} request${as.length === 1 ? '' : 's'} of ${rp.failedWorker} ${inc(rp.failedIncarnation)}`,
      lines, {'data-failed': rp.failedWorker, 'data-plan': rp.id || 0, 'data-requests': as.length});
  } else if (ev.paired) {
    const p = ev.paired;
    const text = p.paired ? `${p.drafterId} drafts for ${p.targetId}` : `${p.drafterId} stops drafting for ${p.targetId}`;
    addEntry(t, 'pairing', 'pairing', text, p.reason ? [p.reason] : [], {'data-drafter': p.drafterId, 'data-target': p.targetId});
  } else if (ev.migration) {
    onMigration(t, ev.migration);
  } else if (ev.strategyChanged) {
    const s = ev.strategyChanged;
    addEntry(t, 'strategy', 'strategy', `strategy ${strip(s.from, 'STRATEGY_')} → ${strip(s.to, 'STRATEGY_')}`, []);
  } else if (ev.placementMoved) {
    const m = ev.placementMoved;
    // A recovery's moves are in its plan.
    if (m.reason !== 'recovery') {
      const p = m.placement || {};
      addEntry(t, 'move', 'move', `${p.requestId} ${m.fromWorker} → ${p.workerId}`, m.reason ? [m.reason] : []);
    }
  } else {
    const kind = Object.keys(ev).find((k) => !['index', 'seq', 'unixNano'].includes(k)) || 'event';
    addEntry(t, kind, 'event', kind, [JSON.stringify(ev[kind])]);
  }
}

function planLine(a) {
  const mode = strip(a.mode, 'RECOVERY_MODE_');
  let how = mode;
  if (mode === 'REUSE') how += ` (checkpoint on ${a.checkpointHolder || a.holder})`;
  else if (a.checkpointHolder || a.holder) how += ` (holder ${a.checkpointHolder || a.holder} lost)`;
  if (a.rebalanced) how += ', rebalanced';
  return `${a.requestId || a.request} → ${a.targetWorker || a.target} ${how}`;
}

// onMigration follows a live migration (Migration events, when the
// controller emits them).
function onMigration(t, m) {
  const stage = strip(m.stage, 'STAGE_') || 'UNSPECIFIED';
  const p = m.placement || {};
  const from = m.fromWorker || p.workerId, to = m.toWorker || p.migrationTarget;
  if (stage === 'STARTED') view.migrations.set(p.requestId, {from, to, since: t});
  else view.migrations.delete(p.requestId);
  addEntry(t, 'migration', 'migration', `migration of ${p.requestId} ${from} → ${to}: ${stage.toLowerCase()}`, m.reason ? [m.reason] : [],
    {'data-request': p.requestId, 'data-stage': stage});
  renderWorkers();
}

// patchWorker applies an event to the worker table at once, before the
// next state arrives.
function patchWorker(id, fields) {
  if (!view.st) return;
  const w = (view.st.workers || []).find((w) => w.id === id);
  if (!w) return;
  // Incarnations are 64-bit: compare them as BigInts.
  if (BigInt(fields.incarnation) < BigInt(w.incarnation)) return;
  if (fields.incarnation !== w.incarnation) w.load = undefined;
  Object.assign(w, fields);
  renderWorkers();
}

function addEntry(t, kind, badgeClass, text, details, attrs) {
  const list = $('timeline');
  const li = h('li', Object.assign({'data-kind': kind, 'data-t': Math.round(t)}, attrs || {}),
    h('time', {}, t ? clock(t) : ''), badge(kind, badgeClass), ' ', text,
    details.length ? h('div', {class: 'detail'}, details.map((d) => h('div', {title: d}, d))) : null);
  // Newest first; an entry older than the first ones (a backlog) goes in
  // its place.
  let before = list.firstChild;
  while (before && Number(before.dataset.t) > t) before = before.nextSibling;
  list.insertBefore(li, before);
  while (list.childNodes.length > TIMELINE_MAX) list.removeChild(list.lastChild);
}

// --- rendering ---

function render() {
  renderHeader();
  renderQuorum();
  renderWorkers();
  renderRequests();
  renderCharts();
}

function renderHeader() {
  const st = view.st;
  $('node').textContent = `${st.node} (${st.nodeState})`;
  const leader = $('leader');
  leader.textContent = st.leader || 'none';
  leader.dataset.leader = st.leader || '';
  $('term').textContent = st.term;
  $('indexes').textContent = `${st.commitIndex} / ${st.appliedIndex}`;
  $('strategy').textContent = `${st.strategy} (λ ${st.lambda})`;
}

function renderQuorum() {
  const st = view.st;
  const rows = (st.quorum || []).map((r) => h('tr', {'data-replica': r.id, 'data-reachable': r.reachable, 'data-state': r.state || ''},
    h('td', {}, r.id, r.self ? h('span', {class: 'since'}, 'this page') : null),
    h('td', {}, r.reachable ? badge(r.state) : '—'),
    h('td', {}, r.leader || (r.reachable ? 'none' : '—')),
    h('td', {class: 'num'}, r.reachable ? r.term : '—'),
    h('td', {class: 'num'}, r.reachable ? r.commitIndex : '—'),
    h('td', {class: 'num'}, r.reachable ? r.appliedIndex : '—'),
    h('td', {title: r.error || ''}, r.reachable ? badge('yes') : badge('no'), r.error ? h('span', {class: 'since'}, shortError(r.error)) : null),
    h('td', {class: 'addrs'}, `raft ${r.raftAddr}`, h('br'), `gRPC ${r.grpcAddr || '—'}`)));
  $('quorum').replaceChildren(...rows);
  $('quorum-note').textContent = st.quorumAt ? `each replica's ClusterStatus, asked ${ago(st.quorumAt, st.now)} ago; tables from ${st.node}'s applied index ${st.appliedIndex}` : 'asking the replicas…';
}

// shortError is a gRPC error's code, or the error's start; the whole
// error is the cell's title.
function shortError(e) {
  const m = /code = (\w+)/.exec(e);
  return m ? m[1] : e.slice(0, 40);
}

function renderWorkers() {
  const st = view.st;
  if (!st) return;
  const out = new Map(), inn = new Map();
  for (const m of view.migrations.values()) {
    out.set(m.from, (out.get(m.from) || 0) + 1);
    inn.set(m.to, (inn.get(m.to) || 0) + 1);
  }
  const rows = (st.workers || []).map((w) => {
    const l = w.load;
    let paired = '—';
    if (w.paired) paired = w.phase === 'ASSIST' ? `drafts for ${w.paired}` : `drafter ${w.paired}`;
    return h('tr', {'data-worker': w.id, 'data-phase': w.phase, 'data-incarnation': w.incarnation, title: w.addr},
      h('td', {}, w.id),
      h('td', {class: 'num', title: w.incarnation}, inc(w.incarnation)),
      h('td', {}, badge(w.phase), w.phaseSince ? h('span', {class: 'since'}, ago(w.phaseSince, st.now)) : null),
      h('td', {class: 'num'}, l ? `${l.running} / ${l.waiting}` : '—'),
      h('td', {class: 'num'}, l ? [bar(l.kvUsed, l.kvTotal), `${l.kvUsed} / ${l.kvTotal}`] : '—'),
      h('td', {class: 'num'}, [bar(w.reservedBytes, w.budgetBytes), `${w.held} (${bytes(w.reservedBytes)} / ${bytes(w.budgetBytes)})`]),
      h('td', {class: 'num'}, l ? `${l.qwMs.toFixed(1)} ms` : '—'),
      h('td', {}, paired),
      h('td', {class: 'num'}, `${out.get(w.id) || 0} / ${inn.get(w.id) || 0}`));
  });
  $('workers').replaceChildren(...rows);
  $('migrating').textContent = view.migrations.size;
}

function renderRequests() {
  const st = view.st;
  const s = st.sample || {};
  $('in-flight').textContent = s.inFlight ?? '—';
  $('running').textContent = s.running ?? '—';
  $('waiting').textContent = s.waiting ?? '—';
  $('recovering').textContent = s.recovering ?? '—';
  const plans = (st.plans || []).slice(0, PLANS_SHOWN).map((p) => {
    const open = p.assignments.filter((a) => a.inFlight).length;
    const rows = p.assignments.slice(0, 10).map((a) => h('tr', {class: a.inFlight ? '' : 'done', 'data-request': a.request},
      h('td', {}, a.request), h('td', {}, '→ ' + a.target), h('td', {}, a.mode),
      h('td', {}, a.mode === 'REUSE' ? `checkpoint on ${a.holder}` : (a.holder ? `holder ${a.holder} lost` : 'no checkpoint')),
      h('td', {}, a.inFlight ? 'in flight' : 'done')));
    if (p.assignments.length > 10) rows.push(h('tr', {}, h('td', {colSpan: 5}, `… and ${p.assignments.length - 10} more`)));
    return h('div', {class: 'plan-box', 'data-plan': p.id, 'data-failed': p.failedWorker},
      h('div', {}, h('b', {}, `plan ${p.id}`), ` — ${p.failedWorker} ${inc(p.failedIncarnation)} failed at ${clock(p.failed)}: `,
        `${p.assignments.length} requests, ${open} still in flight`),
      h('table', {}, h('tbody', {}, rows)));
  });
  $('plans').replaceChildren(...(plans.length ? plans : [h('p', {class: 'note'}, 'none yet')]));
}

// --- charts: hand-drawn SVG ---

const SVGNS = 'http://www.w3.org/2000/svg';

function s(tag, attrs, text) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function niceMax(v) {
  if (v <= 1) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// chart draws series [{name, color, get}] of view.history into svg.
function chart(svg, series, unit) {
  const W = 300, H = 150, L = 34, R = 4, T = 30, B = 14;
  // The window is the history's span, a minute at least and WINDOW_MS at
  // most: a controller that just started fills the chart too.
  const now = view.st.now;
  const first = view.history.length ? view.history[0].t : now;
  const span = Math.min(WINDOW_MS, Math.max(60 * 1000, now - first));
  const t0 = now - span;
  const x = (t) => L + (W - L - R) * (t - t0) / span;
  let top = 0;
  for (const p of view.history) for (const se of series) top = Math.max(top, se.get(p));
  top = niceMax(top);
  const y = (v) => T + (H - T - B) * (1 - v / top);
  const kids = [];
  for (const f of [0, 0.5, 1]) {
    kids.push(s('line', {class: 'grid', x1: L, x2: W - R, y1: y(f * top), y2: y(f * top)}));
    kids.push(s('text', {x: L - 4, y: y(f * top) + 3, 'text-anchor': 'end'}, fmt(f * top)));
  }
  for (const [t, label] of [[t0, '−' + duration(span)], [now - span / 2, '−' + duration(span / 2)], [now, 'now']]) {
    kids.push(s('text', {x: x(t), y: H - 4, 'text-anchor': t === t0 ? 'start' : (t === now ? 'end' : 'middle')}, label));
  }
  for (const m of view.marks) {
    if (m.t < t0) continue;
    kids.push(s('line', {class: 'mark-' + m.kind, x1: x(m.t), x2: x(m.t), y1: T, y2: H - B}));
  }
  let ly = 11;
  for (const se of series) {
    const pts = view.history.map((p) => `${x(p.t).toFixed(1)},${y(se.get(p)).toFixed(1)}`).join(' ');
    kids.push(s('polyline', {points: pts, fill: 'none', stroke: se.color, 'stroke-width': 1.6}));
    const last = view.history.length ? se.get(view.history[view.history.length - 1]) : 0;
    kids.push(s('text', {x: L, y: ly, style: 'fill:' + se.color}, `${se.name}: ${fmt(last)}${unit ? ' ' + unit : ''}`));
    ly += 13;
  }
  svg.replaceChildren(...kids);
}

function duration(ms) {
  const s = Math.round(ms / 1000);
  return s < 120 ? s + ' s' : (s / 60).toFixed(s % 60 ? 1 : 0) + ' min';
}

function fmt(v) {
  if (v >= 100 || Number.isInteger(v)) return String(Math.round(v));
  return v.toFixed(1);
}

function renderCharts() {
  if (!view.st) return;
  const cut = view.st.now - WINDOW_MS;
  view.marks = view.marks.filter((m) => m.t >= cut);
  chart($('chart-queue'), [
    {name: 'waiting', color: '#b45309', get: (p) => p.waiting},
    {name: 'running', color: '#1d4ed8', get: (p) => p.running}]);
  chart($('chart-qw'), [
    {name: 'mean q_w', color: '#1d4ed8', get: (p) => p.qwMs},
    {name: 'max q_w', color: '#b45309', get: (p) => p.qwMaxMs}], 'ms');
  chart($('chart-recovery'), [
    {name: 'in recovery', color: '#b91c1c', get: (p) => p.recovering},
    {name: 'workers out of full service', color: '#7c3aed', get: (p) => Math.max(0, p.workers - p.serving)}]);
}

// A script error is shown, not swallowed (and the browser test fails on
// it).
window.addEventListener('error', (e) => {
  document.body.dataset.error = e.message;
  const conn = $('conn');
  conn.dataset.connected = 'false';
  conn.textContent = 'page error: ' + e.message;
});

connect();
