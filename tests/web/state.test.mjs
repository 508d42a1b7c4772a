// The page's event handling (web_client/state.js) driven by Realtime events in CONTRACT.md's order.
// Run: node --test tests/web/
import assert from 'node:assert/strict';
import { test } from 'node:test';

import {
  AGENT_STATES, DEFAULT_CHARS_PER_SECOND, agentState, heardLength, initialState, latencySummary, reduce,
} from '../../web_client/state.js';

/** Feeds [ms, event] pairs to the reducer; returns the final state and the agent state after each. */
function play(timeline, state = connected()) {
  const states = [];
  for (const [now, event] of timeline) {
    state = reduce(state, event, now);
    states.push(agentState(state));
  }
  return { state, states };
}

const SESSION = {
  type: 'realtime',
  audio: { input: { turn_detection: { type: 'server_vad', threshold: 0.5, silence_duration_ms: 500 } } },
};

function connected(session = SESSION) {
  let state = reduce(initialState(), { type: 'client.connecting' });
  state = reduce(state, { type: 'client.channel_open' });
  return reduce(state, { type: 'session.created', session });
}

const userItem = (id) => ({ type: 'message', role: 'user', id, content: [{ type: 'input_audio', transcript: null }] });
const agentItem = (id, transcript = '') => ({
  type: 'message', role: 'assistant', id, content: [{ type: 'output_audio', transcript }],
});

/** One whole turn as a duplex server sends it over WebRTC, user speech stopping at `t0`. */
function turn(t0, { user = 'u1', agent = 'a1', response = 'r1', text = ['Hello', ' there', '.'] } = {}) {
  return [
    [t0 - 900, { type: 'input_audio_buffer.speech_started', audio_start_ms: 1000, item_id: user }],
    [t0, { type: 'input_audio_buffer.speech_stopped', audio_end_ms: 1900, item_id: user }],
    [t0 + 5, { type: 'input_audio_buffer.committed', item_id: user }],
    [t0 + 6, { type: 'conversation.item.added', item: userItem(user) }],
    [t0 + 7, { type: 'conversation.item.created', item: userItem(user) }],
    [t0 + 8, { type: 'conversation.item.done', item: userItem(user) }],
    [t0 + 10, { type: 'response.created', response: { id: response, status: 'in_progress' } }],
    [t0 + 11, { type: 'response.output_item.added', response_id: response, item: agentItem(agent) }],
    [t0 + 12, { type: 'conversation.item.added', item: agentItem(agent) }],
    [t0 + 13, { type: 'response.content_part.added', response_id: response, item_id: agent }],
    ...text.map((delta, i) => [t0 + 100 + i, {
      type: 'response.output_audio_transcript.delta', response_id: response, item_id: agent, delta,
    }]),
    [t0 + 300, { type: 'output_audio_buffer.started', response_id: response }],
  ];
}

function finish(t, { agent = 'a1', response = 'r1', text = 'Hello there.' } = {}) {
  return [
    [t, { type: 'response.output_audio_transcript.done', response_id: response, item_id: agent, transcript: text }],
    [t + 1, { type: 'response.content_part.done', response_id: response, item_id: agent }],
    [t + 2, { type: 'response.output_item.done', response_id: response, item: agentItem(agent, text) }],
    [t + 3, { type: 'response.done', response: { id: response, status: 'completed', output: [agentItem(agent, text)] } }],
  ];
}

test('connecting, then session.created: the agent listens', () => {
  let state = reduce(initialState(), { type: 'client.connecting' }, 0);
  assert.equal(state.connection, 'connecting');
  assert.equal(agentState(state), null);
  state = reduce(state, { type: 'session.created', session: SESSION }, 1);
  assert.equal(state.connection, 'connected');
  assert.equal(agentState(state), 'listening');
});

test('a whole turn walks through the agent states in order', () => {
  const { state, states } = play([...turn(2000), ...finish(2400),
    [3500, { type: 'output_audio_buffer.stopped', response_id: 'r1' }]]);
  const distinct = states.filter((s, i) => s !== states[i - 1]);
  assert.deepEqual(distinct, ['user_speaking', 'thinking', 'speaking', 'listening']);
  assert.ok(states.every((s) => AGENT_STATES.includes(s)));
  assert.deepEqual(state.items.map((item) => [item.role, item.id, item.text, item.status]), [
    ['user', 'u1', '', 'completed'],
    ['assistant', 'a1', 'Hello there.', 'completed'],
  ]);
});

test('the agent stays "speaking" while its audio plays after response.done', () => {
  const { state } = play([...turn(2000), ...finish(2400)]);
  assert.equal(state.responseId, null);
  assert.equal(agentState(state), 'speaking');
});

test('agent text appears delta by delta, before its audio starts', () => {
  const timeline = turn(2000);
  const beforeAudio = timeline.slice(0, -1);
  const { state } = play(beforeAudio);
  assert.equal(state.items.at(-1).text, 'Hello there.');
  assert.equal(agentState(state), 'thinking');
  const partial = play(beforeAudio.slice(0, -1)).state;
  assert.equal(partial.items.at(-1).text, 'Hello there');
});

test('items announced several times (added, created, done) make one transcript entry', () => {
  const { state } = play(turn(2000));
  assert.equal(state.items.filter((item) => item.id === 'u1').length, 1);
  assert.equal(state.items.filter((item) => item.id === 'a1').length, 1);
});

test('the user transcription fills the user entry when the preset transcribes', () => {
  const { state } = play([...turn(2000),
    [2350, { type: 'conversation.item.input_audio_transcription.completed', item_id: 'u1', transcript: 'Hi agent' }]]);
  assert.equal(state.items.find((item) => item.id === 'u1').text, 'Hi agent');
});

test('voice-to-voice latency runs from speech_stopped to output_audio_buffer.started, per turn', () => {
  const { state } = play([
    ...turn(2000), ...finish(2400), [4000, { type: 'output_audio_buffer.stopped', response_id: 'r1' }],
    ...turn(10_000, { user: 'u2', agent: 'a2', response: 'r2' }),
  ]);
  assert.deepEqual(state.latencies, [{ responseId: 'r1', ms: 300 }, { responseId: 'r2', ms: 300 }]);
  assert.deepEqual(latencySummary(state), { last: 300, median: 300, count: 2 });
});

test('latency summary: median of an even count, empty before the first answer', () => {
  assert.deepEqual(latencySummary(initialState()), { last: null, median: null, count: 0 });
  const state = { ...initialState(), latencies: [100, 400, 200, 900].map((ms, i) => ({ responseId: `r${i}`, ms })) };
  assert.deepEqual(latencySummary(state), { last: 900, median: 300, count: 4 });
});

test('speech resumed before the answer: that pause is no latency sample', () => {
  const { state } = play([
    [100, { type: 'input_audio_buffer.speech_started' }],
    [600, { type: 'input_audio_buffer.speech_stopped' }],
    [700, { type: 'input_audio_buffer.speech_started' }],
    [1500, { type: 'input_audio_buffer.speech_stopped' }],
    [1600, { type: 'response.created', response: { id: 'r1' } }],
    [1900, { type: 'output_audio_buffer.started', response_id: 'r1' }],
  ]);
  assert.deepEqual(state.latencies, [{ responseId: 'r1', ms: 400 }]);
});

/** A turn whose answer is playing, then a confirmed barge-in in CONTRACT.md's order. */
function bargeIn(audioEndMs) {
  return [
    ...turn(2000, { text: ['One two three four five six seven eight nine ten eleven twelve.'] }),
    [3300, { type: 'input_audio_buffer.speech_started', audio_start_ms: 5000, item_id: 'u2' }],
    [3301, { type: 'output_audio_buffer.cleared', response_id: 'r1' }],
    [3302, { type: 'response.done', response: { id: 'r1', status: 'cancelled', output: [agentItem('a1')] } }],
    [3303, { type: 'conversation.item.truncated', item_id: 'a1', content_index: 0, audio_end_ms: audioEndMs }],
  ];
}

test('barge-in: the agent shows "interrupted" while the user holds the floor, then thinks', () => {
  const timeline = [...bargeIn(1000),
    [4200, { type: 'input_audio_buffer.speech_stopped', item_id: 'u2' }]];
  const { state, states } = play(timeline);
  const at = (type) => states[timeline.findIndex(([, event]) => event.type === type && event.item_id === 'u2')];
  assert.equal(at('input_audio_buffer.speech_started'), 'interrupted');
  assert.deepEqual(states.slice(-5, -1), ['interrupted', 'interrupted', 'interrupted', 'interrupted']);
  assert.equal(states.at(-1), 'thinking');
  assert.equal(state.playback, null);
  assert.equal(state.responseId, null);
});

test('barge-in truncates the agent entry to what was heard, word-aligned', () => {
  const { state } = play(bargeIn(1000));
  const agent = state.items.find((item) => item.id === 'a1');
  assert.equal(agent.status, 'truncated');
  const heard = agent.text.slice(0, agent.heardChars);
  assert.equal(heard, agent.text.slice(0, heardLength(agent.text, 1000, DEFAULT_CHARS_PER_SECOND)));
  assert.ok(heard.length > 0 && heard.length < agent.text.length, heard);
  assert.match(agent.text.slice(agent.heardChars), /^\s/, 'the cut falls between words');
  // The cancelled response's snapshot does not restore the unheard text as heard.
  assert.equal(agent.text, 'One two three four five six seven eight nine ten eleven twelve.');
});

test('truncation: nothing heard, everything heard', () => {
  assert.equal(play(bargeIn(0)).state.items.find((i) => i.id === 'a1').heardChars, 0);
  const all = play(bargeIn(60_000)).state.items.find((i) => i.id === 'a1');
  assert.equal(all.heardChars, all.text.length);
});

test('heardLength scales with the audio heard and cuts at word starts', () => {
  const text = 'alpha beta gamma delta';
  assert.equal(heardLength(text, 0, 10), 0);
  assert.equal(heardLength(text, 500, 10), 5);   // exactly at the space after "alpha"
  assert.equal(heardLength(text, 800, 10), 5);   // inside "beta": back to the space after "alpha"
  assert.equal(heardLength(text, 1300, 10), 10); // inside "gamma": back to the space after "beta"
  assert.equal(heardLength(text, 200, 10), 2);   // inside the first word: no earlier boundary
  assert.equal(heardLength(text, 10_000, 10), text.length);
});

test('the speaking rate measured on a completed answer sets where later truncations cut', () => {
  // "Hello there." (12 chars) played for 1.2 s: 10 chars per second.
  const { state } = play([...turn(2000), ...finish(2400),
    [3500, { type: 'output_audio_buffer.stopped', response_id: 'r1' }]]);
  assert.equal(state.charsPerSecond, 10);
  const cut = reduce(state, { type: 'conversation.item.truncated', item_id: 'a1', audio_end_ms: 600 }, 3600);
  assert.equal(cut.items.find((i) => i.id === 'a1').heardChars, 5);
});

test('speech over a silent agent is not an interruption', () => {
  const { states } = play([[100, { type: 'input_audio_buffer.speech_started' }]]);
  assert.deepEqual(states, ['user_speaking']);
});

test('speech while the answer is still being generated (no audio yet) is an interruption', () => {
  const { states } = play([...turn(2000).slice(0, -1),
    [2200, { type: 'input_audio_buffer.speech_started' }]]);
  assert.equal(states.at(-1), 'interrupted');
});

test('without automatic answers (create_response false) the end of speech goes back to listening', () => {
  const manual = { audio: { input: { turn_detection: { type: 'server_vad', create_response: false } } } };
  const { state, states } = play([[100, { type: 'input_audio_buffer.speech_started' }],
    [900, { type: 'input_audio_buffer.speech_stopped' }]], connected(manual));
  assert.equal(states.at(-1), 'listening');
  assert.equal(state.speechStoppedAt, null);
  const none = { audio: { input: { turn_detection: null } } };
  assert.equal(play([[900, { type: 'input_audio_buffer.speech_stopped' }]], connected(none)).states.at(-1), 'listening');
});

test('an error event is shown and the call stays up', () => {
  const { state } = play([[10, { type: 'error', error: { type: 'invalid_request_error', code: 'unknown_parameter',
    message: "semantic_vad is not supported", param: 'session.audio.input.turn_detection.type' } }]]);
  assert.equal(state.error.message, 'semantic_vad is not supported');
  assert.equal(state.error.code, 'unknown_parameter');
  assert.equal(state.connection, 'connected');
  assert.equal(agentState(state), 'listening');
});

test('a failed response marks its entry failed and shows the server\'s message', () => {
  const { state } = play([...turn(2000),
    [2500, { type: 'error', error: { message: 'stage talker failed' } }],
    [2501, { type: 'response.done', response: { id: 'r1', status: 'failed',
      status_details: { type: 'failed', error: { type: 'server_error', message: 'stage talker failed' } } } }]]);
  assert.equal(state.items.find((item) => item.id === 'a1').status, 'failed');
  assert.equal(state.error.message, 'stage talker failed');
  assert.equal(state.responseId, null);
});

test('the server closing the call mid-answer is a failure (no response.done)', () => {
  const { state } = play([...turn(2000), [2500, { type: 'client.channel_closed' }]]);
  assert.equal(state.connection, 'closed');
  assert.equal(state.items.find((item) => item.id === 'a1').status, 'failed');
  assert.match(state.error.message, /before the answer finished/);
  assert.equal(agentState(state), null);
});

test('the server closing an idle call ends it with a notice, and a late close changes nothing', () => {
  const { state } = play([[10, { type: 'client.channel_closed' }]]);
  assert.equal(state.connection, 'closed');
  assert.match(state.error.message, /ended the call/);
  const hungUp = play([...turn(2000), [2500, { type: 'client.hangup' }]]).state;
  assert.equal(reduce(hungUp, { type: 'client.channel_closed' }, 2600), hungUp);
});

test('hanging up mid-answer cancels it without an error, and keeps the transcript', () => {
  const { state } = play([...turn(2000), [2500, { type: 'client.hangup' }]]);
  assert.equal(state.connection, 'closed');
  assert.equal(state.error, null);
  assert.equal(state.items.find((item) => item.id === 'a1').status, 'cancelled');
  assert.equal(state.items.length, 2);
});

test('a call that fails to start (e.g. HTTP 503) shows why; the next call starts clean', () => {
  let state = reduce(initialState(), { type: 'client.connecting' }, 0);
  state = reduce(state, { type: 'client.failed', message: 'The server has no free session (HTTP 503).' }, 1);
  assert.equal(state.connection, 'failed');
  assert.equal(state.error.message, 'The server has no free session (HTTP 503).');
  state = reduce(state, { type: 'client.connecting' }, 2);
  assert.deepEqual(state, initialState('connecting'));
});

test('events the client does not use leave the state untouched (same object)', () => {
  const state = connected();
  for (const type of ['rate_limits.updated', 'response.content_part.added', 'input_audio_buffer.committed', 'bogus']) {
    assert.equal(reduce(state, { type }, 5), state, type);
  }
  assert.equal(reduce(state, { type: 'conversation.item.added', item: { type: 'function_call', id: 'f' } }, 5).items.length, 0);
});
