/**
 * Draws the client state (state.js) into the page. The view owns the transcript's <li> elements,
 * keyed by item id for the life of the page: text grows in place, so the aria-live log announces
 * new entries instead of re-reading the whole conversation at every delta.
 */
import { meterValue } from './meter.js';
import { agentState, latencySummary } from './state.js';

const AGENT_LABELS = {
  listening: 'listening',
  user_speaking: 'hearing you',
  thinking: 'thinking…',
  speaking: 'speaking',
  interrupted: 'interrupted',
};

const CONNECTION_LABELS = {
  idle: 'Not connected',
  connecting: 'Connecting…',
  connected: 'Connected',
  closed: 'Call ended',
  failed: 'Call failed',
};

const STATUS_NOTES = {
  truncated: 'interrupted',
  cancelled: 'cancelled',
  failed: 'failed',
  incomplete: 'stopped at the length limit',
};

// How the session ends a turn, for the settings' "server's choice" (from session.created/updated).
const TURN_LABELS = {
  server_vad: 'after a silence',
  semantic_vad: 'when I have finished',
  manual: 'manual',
};

const formatMs = (ms) => (ms === null ? '–' : `${Math.round(ms)} ms`);

/** The "server's choice" option's text: what the session does now, once the server has said. */
export function serverTurnsText(session) {
  const detection = session?.audio?.input?.turn_detection;
  const label = TURN_LABELS[detection === null ? 'manual' : detection?.type];
  return label ? `The server's choice: ${label}` : "The server's choice";
}

export function createView(doc) {
  const root = doc.documentElement;
  const $ = (id) => doc.getElementById(id);
  const connectButton = $('connect');
  const hangupButton = $('hangup');
  const errorBox = $('error');
  const transcript = $('transcript');
  const serverTurns = $('turn-detection-server');
  const entries = new Map(); // item id -> {li, text, meta, item, latencyMs}
  const thumbnails = new Map(); // user item id -> what the camera showed when the turn was committed
  let shown = null;

  function drawText(node, item) {
    node.text.replaceChildren();
    if (item.heardChars === null) {
      node.text.textContent = item.text || (item.role === 'user' ? '(speech)' : '…');
      return;
    }
    // The space before the first unheard word stays plain: the strike starts on a word.
    const rest = item.text.slice(item.heardChars);
    const space = rest.match(/^\s*/)[0];
    const unheard = doc.createElement('s');
    unheard.className = 'unheard';
    unheard.textContent = rest.slice(space.length).trimEnd();
    node.text.append(item.text.slice(0, item.heardChars) + space, unheard);
  }

  function drawEntry(item, latencyMs) {
    let node = entries.get(item.id);
    if (!node) {
      const li = doc.createElement('li');
      li.dataset.role = item.role;
      const who = doc.createElement('span');
      who.className = 'who';
      who.textContent = item.role === 'user' ? 'You' : 'Agent';
      const text = doc.createElement('p');
      text.className = 'text';
      const meta = doc.createElement('span');
      meta.className = 'meta';
      li.append(who, text, meta);
      transcript.append(li);
      node = { li, text, meta, item: null, latencyMs: null };
      entries.set(item.id, node);
    }
    if (node.item === item && node.latencyMs === latencyMs) return;
    node.li.dataset.status = item.status;
    drawText(node, item);
    const cut = item.heardChars !== null && item.heardChars < item.text.length;
    const notes = [
      cut ? 'interrupted: the struck-out part was not heard' : STATUS_NOTES[item.status],
      latencyMs === undefined ? null : `voice-to-voice ${formatMs(latencyMs)}`,
    ];
    node.meta.textContent = notes.filter(Boolean).join(' · ');
    node.item = item;
    node.latencyMs = latencyMs;
    drawThumbnail(node, item.id);
  }

  function drawThumbnail(node, id) {
    const url = thumbnails.get(id);
    if (url === undefined || node.li.querySelector('img.seen')) return;
    const img = doc.createElement('img');
    img.className = 'seen';
    img.src = url;
    img.alt = 'What the agent saw during this turn';
    node.li.insertBefore(img, node.meta);
  }

  /** Shows, in the transcript, the picture the camera showed for user turn `itemId`. */
  function addThumbnail(itemId, url) {
    thumbnails.set(itemId, url);
    const node = entries.get(itemId);
    if (node) drawThumbnail(node, itemId);
  }

  function drawTranscript(state) {
    const ids = new Set(state.items.map((item) => item.id));
    for (const [id, node] of entries) {
      if (!ids.has(id)) {
        node.li.remove();
        entries.delete(id);
        thumbnails.delete(id);
      }
    }
    const latencyByResponse = new Map(state.latencies.map((turn) => [turn.responseId, turn.ms]));
    const follow = transcript.scrollHeight - transcript.scrollTop - transcript.clientHeight < 40;
    for (const item of state.items) {
      drawEntry(item, item.role === 'assistant' ? latencyByResponse.get(item.responseId) : undefined);
    }
    if (follow) transcript.scrollTop = transcript.scrollHeight;
    $('transcript-empty').hidden = state.items.length > 0;
  }

  function drawControls(state) {
    const idle = ['idle', 'closed', 'failed'].includes(state.connection);
    const hadFocus = doc.activeElement;
    connectButton.disabled = !idle;
    hangupButton.disabled = state.connection !== 'connected';
    // A button that just became disabled drops the keyboard focus: hand it to its counterpart.
    if (hadFocus === connectButton && connectButton.disabled && !hangupButton.disabled) hangupButton.focus();
    if (hadFocus === hangupButton && hangupButton.disabled) connectButton.focus();
  }

  /** Brings the page in line with `state`; a state already drawn costs nothing. */
  function render(state) {
    if (state === shown) return;
    const agent = agentState(state);
    root.dataset.connection = state.connection;
    if (agent === null) delete root.dataset.state;
    else root.dataset.state = agent;
    $('connection').textContent = CONNECTION_LABELS[state.connection];
    $('agent-state').textContent = agent === null ? 'not connected' : AGENT_LABELS[agent];
    drawControls(state);

    errorBox.hidden = state.error === null;
    errorBox.textContent = state.error?.message ?? '';

    const latency = latencySummary(state);
    $('latency-last').textContent = formatMs(latency.last);
    $('latency-median').textContent = formatMs(latency.median);
    $('latency-count').textContent = `${latency.count} turn${latency.count === 1 ? '' : 's'}`;

    drawTranscript(state);
    const turns = serverTurnsText(state.session);
    if (serverTurns.textContent !== turns) serverTurns.textContent = turns;
    shown = state;
  }

  /** Shows the input and agent levels (RMS) on the meters and as data-*-level hooks. */
  function renderLevels(local, remote) {
    $('local-level').value = meterValue(local);
    $('remote-level').value = meterValue(remote);
    root.dataset.localLevel = local.toFixed(4);
    root.dataset.remoteLevel = remote.toFixed(4);
  }

  return { render, renderLevels, addThumbnail };
}
