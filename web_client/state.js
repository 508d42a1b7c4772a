/**
 * The voice client's model: a pure reducer over the Realtime server events of CONTRACT.md and the
 * page's own `client.*` events. No DOM and no WebRTC here, so Node's test runner drives it directly.
 *
 * The page holds one state object. `reduce(state, event, now)` returns a new object for every event
 * it understands and the very same object for the rest, so the view re-renders only on change.
 * `now` is the client's clock in ms (performance.now() in the page): voice-to-voice latency is
 * measured where the user hears it. A call starts from a fresh state (`client.connecting`); the last
 * call's transcript stays on screen until then.
 *
 * Client events (sent by the page's glue, never by the server):
 *   client.connecting          a new call begins
 *   client.channel_open        the `oai-events` data channel opened
 *   client.hangup              the user hung up
 *   client.channel_closed      the server closed the call
 *   client.failed {message}    the call could not start or broke (microphone, HTTP, ICE)
 *   client.error {message}     a failure that leaves the call as it is (e.g. switching microphone)
 */

/** The values of the page's `data-state` (CONTRACT.md, "Web client hooks"). */
export const AGENT_STATES = Object.freeze([
  'listening', 'user_speaking', 'thinking', 'speaking', 'interrupted',
]);

// Speaking rate assumed until a completed answer measures the voice's own: ~150 words a minute.
export const DEFAULT_CHARS_PER_SECOND = 14;

// Answers shorter than this are too short to measure a speaking rate on.
const MIN_CALIBRATION_MS = 1000;

export function initialState(connection = 'idle') {
  return {
    connection,               // idle | connecting | connected | closed | failed
    session: null,            // the server's session, from session.created / session.updated
    userSpeaking: false,      // input_audio_buffer.speech_started .. speech_stopped
    bargedIn: false,          // the agent was cut off during the user's current speech
    awaitingResponse: false,  // the user's turn ended and the server is expected to answer
    responseId: null,         // the response in progress: response.created .. response.done
    playback: null,           // {responseId, startedAt}: output_audio_buffer.started .. stopped / cleared
    speechStoppedAt: null,    // client time of the speech_stopped that awaits its first audio
    latencies: [],            // {responseId, ms} per answered turn, in order
    charsPerSecond: DEFAULT_CHARS_PER_SECOND,
    items: [],                // transcript entries, see `entry`
    error: null,              // {message, code} of the last failure; cleared by the next call
  };
}

/** The agent's state at a glance, one of AGENT_STATES; null while no call is up. */
export function agentState(state) {
  if (state.connection !== 'connected') return null;
  if (state.userSpeaking) return state.bargedIn ? 'interrupted' : 'user_speaking';
  if (state.playback !== null) return 'speaking';
  if (state.awaitingResponse || state.responseId !== null) return 'thinking';
  return 'listening';
}

/** Last and median voice-to-voice latency in ms (null before the first answer). */
export function latencySummary(state) {
  const values = state.latencies.map((turn) => turn.ms).sort((a, b) => a - b);
  if (values.length === 0) return { last: null, median: null, count: 0 };
  const mid = Math.floor(values.length / 2);
  const median = values.length % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
  return { last: state.latencies.at(-1).ms, median, count: values.length };
}

/**
 * How many characters of `text` the user heard before `audioEndMs` of its audio stopped, at
 * `charsPerSecond`; cut back to a word boundary so a half-heard word counts as unheard.
 */
export function heardLength(text, audioEndMs, charsPerSecond) {
  const chars = Math.round((Math.max(0, audioEndMs) / 1000) * charsPerSecond);
  if (chars >= text.length) return text.length;
  if (/\s/.test(text[chars])) return chars;
  const space = text.lastIndexOf(' ', chars);
  return space > 0 ? space : chars;
}

/** Whether the server answers a turn by itself once the user stops (server_vad, create_response). */
function answersAutomatically(session) {
  const detection = session?.audio?.input?.turn_detection;
  if (detection === null) return false;
  return detection?.create_response !== false;
}

/** A transcript entry; `heardChars` is set once the agent was cut off (the rest was never heard). */
function entry(id, role) {
  return { id, role, text: '', status: 'in_progress', responseId: null, heardChars: null };
}

/** `items` with the entry `id` changed by `change(entry) -> fields`, created first if missing. */
function withEntry(items, id, role, change) {
  const index = items.findIndex((item) => item.id === id);
  const current = index < 0 ? entry(id, role) : items[index];
  const next = { ...current, ...change(current) };
  if (index < 0) return [...items, next];
  const copy = items.slice();
  copy[index] = next;
  return copy;
}

/** The text a Realtime item's content parts carry (transcript of audio, or text), or null. */
function contentText(content) {
  const texts = (content ?? [])
    .map((part) => part.transcript ?? part.text)
    .filter((text) => typeof text === 'string');
  return texts.length ? texts.join('') : null;
}

/** An entry's new whole text; a truncated entry keeps its own, with the unheard part marked. */
function replaceText(current, text) {
  return current.status === 'truncated' ? {} : { text };
}

/** Merges a server item snapshot into the transcript; messages only (no tool calls). */
function mergeItem(items, item, responseId) {
  if (item?.type !== 'message' || !['user', 'assistant'].includes(item.role)) return items;
  const text = contentText(item.content);
  return withEntry(items, item.id, item.role, (current) => ({
    ...(text ? replaceText(current, text) : {}),
    ...(item.role === 'user' ? { status: 'completed' } : {}),
    ...(responseId ? { responseId } : {}),
  }));
}

function appendDelta(state, event) {
  return {
    ...state,
    items: withEntry(state.items, event.item_id, 'assistant', (current) => ({
      text: current.text + (event.delta ?? ''),
      responseId: event.response_id ?? current.responseId,
    })),
  };
}

function finishText(state, text, event) {
  if (typeof text !== 'string') return state;
  return {
    ...state,
    items: withEntry(state.items, event.item_id, 'assistant', (current) => replaceText(current, text)),
  };
}

/** Ends the call: nothing plays any more, and an answer still in progress gets `entryStatus`. */
function endCall(state, connection, entryStatus, error) {
  const items = state.items.map((item) => (
    item.role === 'assistant' && item.status === 'in_progress' ? { ...item, status: entryStatus } : item
  ));
  return {
    ...state, connection, items, error: error ?? state.error,
    userSpeaking: false, bargedIn: false, awaitingResponse: false, responseId: null,
    playback: null, speechStoppedAt: null,
  };
}

/** The speaking rate an answer that played to its end shows (chars per second), or the old one. */
function calibratedRate(state, now) {
  if (state.playback === null) return state.charsPerSecond;
  const { responseId, startedAt } = state.playback;
  const played = now - startedAt;
  const answer = state.items.find((item) => item.responseId === responseId && item.role === 'assistant');
  if (!answer || answer.status !== 'completed' || !answer.text || played < MIN_CALIBRATION_MS) {
    return state.charsPerSecond;
  }
  return answer.text.length / (played / 1000);
}

const handlers = {
  'session.created': (state, event) => ({ ...state, connection: 'connected', session: event.session }),
  'session.updated': (state, event) => ({ ...state, session: event.session }),

  'input_audio_buffer.speech_started': (state) => ({
    ...state,
    userSpeaking: true,
    // Speech over an answer in progress is a barge-in (the server only reports confirmed ones).
    bargedIn: state.playback !== null || state.responseId !== null,
    awaitingResponse: false,
    speechStoppedAt: null,
  }),
  'input_audio_buffer.speech_stopped': (state, event, now) => {
    const answers = answersAutomatically(state.session);
    return {
      ...state, userSpeaking: false, bargedIn: false,
      awaitingResponse: answers, speechStoppedAt: answers ? now : null,
    };
  },

  'conversation.item.added': (state, event) => ({ ...state, items: mergeItem(state.items, event.item) }),
  'conversation.item.created': (state, event) => ({ ...state, items: mergeItem(state.items, event.item) }),
  'conversation.item.done': (state, event) => ({ ...state, items: mergeItem(state.items, event.item) }),
  'response.output_item.added': (state, event) => ({
    ...state, items: mergeItem(state.items, event.item, event.response_id),
  }),
  'response.output_item.done': (state, event) => ({
    ...state, items: mergeItem(state.items, event.item, event.response_id),
  }),
  'conversation.item.input_audio_transcription.completed': (state, event) => ({
    ...state,
    items: withEntry(state.items, event.item_id, 'user', () => ({ text: event.transcript ?? '' })),
  }),

  'response.created': (state, event) => ({
    ...state, responseId: event.response?.id ?? null, awaitingResponse: false,
  }),
  'response.output_audio_transcript.delta': appendDelta,
  'response.output_text.delta': appendDelta,
  'response.output_audio_transcript.done': (state, event) => finishText(state, event.transcript, event),
  'response.output_text.done': (state, event) => finishText(state, event.text, event),
  'response.done': (state, event) => {
    const response = event.response ?? {};
    let items = (response.output ?? []).reduce((acc, item) => mergeItem(acc, item, response.id), state.items);
    const status = ['cancelled', 'failed', 'incomplete'].includes(response.status) ? response.status : 'completed';
    items = items.map((item) => (
      item.responseId === response.id && item.status !== 'truncated' ? { ...item, status } : item
    ));
    const failure = response.status === 'failed'
      ? { message: response.status_details?.error?.message ?? 'The answer failed on the server.',
          code: response.status_details?.error?.code ?? null }
      : null;
    return {
      ...state, items, awaitingResponse: false,
      responseId: state.responseId === response.id ? null : state.responseId,
      bargedIn: state.bargedIn || response.status === 'cancelled',
      error: failure ?? state.error,
    };
  },

  'output_audio_buffer.started': (state, event, now) => {
    const responseId = event.response_id ?? state.responseId;
    const latencies = state.speechStoppedAt === null
      ? state.latencies
      : [...state.latencies, { responseId, ms: now - state.speechStoppedAt }];
    return {
      ...state, latencies, playback: { responseId, startedAt: now },
      speechStoppedAt: null, awaitingResponse: false,
    };
  },
  'output_audio_buffer.stopped': (state, event, now) => ({
    ...state, playback: null, charsPerSecond: calibratedRate(state, now),
  }),
  'output_audio_buffer.cleared': (state) => ({ ...state, playback: null, bargedIn: true }),
  'conversation.item.truncated': (state, event) => ({
    ...state,
    bargedIn: true,
    items: withEntry(state.items, event.item_id, 'assistant', (current) => ({
      status: 'truncated',
      heardChars: heardLength(current.text, event.audio_end_ms ?? 0, state.charsPerSecond),
    })),
  }),

  error: (state, event) => ({
    ...state,
    error: { message: event.error?.message ?? 'The server reported an error.', code: event.error?.code ?? null },
  }),

  'client.connecting': () => initialState('connecting'),
  'client.channel_open': (state) => ({ ...state, connection: 'connected' }),
  'client.hangup': (state) => endCall(state, 'closed', 'cancelled', null),
  'client.channel_closed': (state) => (state.connection !== 'connected' ? state : endCall(
    state, 'closed', 'failed',
    // A stream that ends without response.done is a failure (CONTRACT.md, "Streaming failure").
    { message: state.responseId !== null
      ? 'The server closed the call before the answer finished.'
      : 'The server ended the call.', code: null },
  )),
  'client.failed': (state, event) => endCall(state, 'failed', 'failed', { message: event.message, code: null }),
  'client.error': (state, event) => ({ ...state, error: { message: event.message, code: null } }),
};

/** The state after `event` (a parsed Realtime event or a client event) arrived at client time `now`. */
export function reduce(state, event, now = 0) {
  const handler = Object.hasOwn(handlers, event?.type) ? handlers[event.type] : null;
  return handler ? handler(state, event, now) : state;
}
