// What the page sends (web_client/protocol.js) and how it words failures; levels (meter.js).
// Run: node --test tests/web/
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { readFileSync } from 'node:fs';

import { meterValue, rms } from '../../web_client/meter.js';
import {
  audioConstraints, authHeaders, callIdFromLocation, describeHttpError, describeMediaError, hangupPath,
  modelSees, sessionUpdate,
} from '../../web_client/protocol.js';
import { serverTurnsText } from '../../web_client/view.js';

const SETTINGS = { instructions: '', voice: '', vadThreshold: 0.6, silenceDurationMs: 700 };

test('session.update keeps the server\'s turn detection unless the user chose one', () => {
  for (const settings of [SETTINGS, { ...SETTINGS, turnDetection: '', eagerness: 'high' }]) {
    const event = sessionUpdate(settings);
    assert.equal(event.type, 'session.update');
    assert.deepEqual(event.session, { type: 'realtime' }, 'nothing to change: the server\'s own');
    assert.deepEqual(JSON.parse(JSON.stringify(event)), event, 'the event survives JSON as it is');
  }
});

test('the page\'s settings form starts on the server\'s turn detection', () => {
  const html = readFileSync(new URL('../../web_client/index.html', import.meta.url), 'utf8');
  const select = html.match(/<select id="turn-detection"[^>]*>([\s\S]*?)<\/select>/);
  assert.ok(select, 'index.html has the turn detection select');
  const options = [...select[1].matchAll(/<option([^>]*)>/g)].map((m) => m[1]);
  const selected = options.filter((attributes) => /\bselected\b/.test(attributes));
  assert.equal(selected.length, 1, options.join(' | '));
  assert.match(selected[0], /value=""/, 'the selected option sends no turn detection');
  assert.match(selected[0], /id="turn-detection-server"/, 'the view names the server\'s choice there');
});

test('session.update carries server_vad turn detection from the settings when chosen', () => {
  const event = sessionUpdate({ ...SETTINGS, turnDetection: 'server_vad' });
  assert.deepEqual(event.session.audio.input.turn_detection, {
    type: 'server_vad', threshold: 0.6, silence_duration_ms: 700, create_response: true, interrupt_response: true,
  });
  assert.equal('instructions' in event.session, false, 'empty instructions keep the server default');
  assert.equal('output' in event.session.audio, false, 'an empty voice keeps the server default');
});

test('session.update carries semantic_vad with its eagerness when chosen', () => {
  const event = sessionUpdate({ ...SETTINGS, turnDetection: 'semantic_vad', eagerness: 'high' });
  assert.deepEqual(event.session.audio.input.turn_detection, {
    type: 'semantic_vad', eagerness: 'high', create_response: true, interrupt_response: true,
  });
});

test('the server\'s choice is named once the session says what it is', () => {
  const session = (turnDetection) => ({ audio: { input: { turn_detection: turnDetection } } });
  assert.equal(serverTurnsText(null), 'The server\'s choice');
  assert.equal(serverTurnsText(session({ type: 'semantic_vad', eagerness: 'auto' })),
    'The server\'s choice: when I have finished');
  assert.equal(serverTurnsText(session({ type: 'server_vad' })), 'The server\'s choice: after a silence');
  assert.equal(serverTurnsText(session(null)), 'The server\'s choice: manual');
});

test('session.update sends instructions and voice when given', () => {
  const { session } = sessionUpdate({ ...SETTINGS, instructions: '  Be brief. ', voice: ' Ethan ' });
  assert.equal(session.instructions, 'Be brief.');
  assert.deepEqual(session.audio, { output: { voice: 'Ethan' } });
  const both = sessionUpdate({ ...SETTINGS, voice: 'Ethan', turnDetection: 'semantic_vad' }).session.audio;
  assert.deepEqual(Object.keys(both).sort(), ['input', 'output']);
});

test('the API key becomes a Bearer header, and no header without one', () => {
  assert.deepEqual(authHeaders(' sk-test '), { Authorization: 'Bearer sk-test' });
  assert.deepEqual(authHeaders(''), {});
  assert.deepEqual(authHeaders(undefined), {});
});

test('the call id comes from the Location header and makes the hang-up path', () => {
  assert.equal(callIdFromLocation('/v1/realtime/calls/rtc_abc123'), 'rtc_abc123');
  assert.equal(callIdFromLocation('http://127.0.0.1:8000/v1/realtime/calls/rtc_x'), 'rtc_x');
  assert.equal(callIdFromLocation(null), null);
  assert.equal(callIdFromLocation('/somewhere/else'), null);
  assert.equal(callIdFromLocation('/v1/realtime/calls/'), null);
  assert.equal(hangupPath('rtc_abc123'), '/v1/realtime/calls/rtc_abc123/hangup');
  assert.equal(hangupPath('a/b'), '/v1/realtime/calls/a%2Fb/hangup');
});

test('getUserMedia constraints: exact device when chosen, processing flags as set', () => {
  const flags = { echoCancellation: false, noiseSuppression: false, autoGainControl: false };
  assert.deepEqual(audioConstraints({ deviceId: 'mic-2', ...flags }), { deviceId: { exact: 'mic-2' }, ...flags });
  assert.deepEqual(audioConstraints({ deviceId: '', ...flags, echoCancellation: true }),
    { ...flags, echoCancellation: true });
});

const errorBody = (message) => JSON.stringify({ error: { message, type: 'invalid_request_error', param: null, code: null } });

test('HTTP errors show the server\'s OpenAI-style message', () => {
  const busy = describeHttpError(503, errorBody('maximum number of sessions (8) reached'), '5');
  assert.match(busy, /no free session/);
  assert.match(busy, /HTTP 503/);
  assert.match(busy, /maximum number of sessions \(8\) reached/);
  assert.match(busy, /in 5 s/);
  assert.match(describeHttpError(503, '', null), /Try again later/);
  const key = describeHttpError(401, errorBody('Incorrect API key provided'), null);
  assert.match(key, /API key/);
  assert.match(key, /Incorrect API key provided/);
  assert.match(describeHttpError(400, errorBody('invalid SDP offer'), null), /refused the call \(HTTP 400\): invalid SDP offer/);
  assert.match(describeHttpError(500, errorBody('pipeline not ready'), null), /HTTP 500.*pipeline not ready/);
});

test('HTTP error bodies that are not OpenAI JSON: short text shown, pages not', () => {
  assert.match(describeHttpError(502, 'Bad gateway', null), /HTTP 502\): Bad gateway\./);
  assert.equal(describeHttpError(502, '<html><body>proxy</body></html>', null),
    'The server failed to start the call (HTTP 502).');
  assert.equal(describeHttpError(404, '{"detail":"Not Found"}', null), 'The server refused the call (HTTP 404).');
});

test('microphone failures are told apart by the DOMException name', () => {
  const named = (name) => describeMediaError({ name, message: 'x' });
  assert.match(named('NotAllowedError'), /permission was denied/);
  assert.match(named('NotFoundError'), /No microphone/);
  assert.match(named('NotReadableError'), /another application/);
  assert.match(named('OverconstrainedError'), /Choose another one/);
  assert.match(describeMediaError({ name: 'AbortError', message: 'Starting audio failed' }), /Starting audio failed/);
});

test('rms and the dB meter scale', () => {
  assert.equal(rms(new Float32Array(0)), 0);
  assert.equal(rms(Float32Array.from([0.5, -0.5, 0.5, -0.5])), 0.5);
  assert.equal(meterValue(0), 0);
  assert.equal(meterValue(1), 1);
  assert.ok(Math.abs(meterValue(0.001) - 0) < 1e-9, '-60 dBFS is the floor');
  assert.ok(Math.abs(meterValue(0.0316) - 0.5) < 0.01, '-30 dBFS is half way');
  assert.ok(meterValue(0.1) > meterValue(0.01));
});

test('a model sees when /v1/models lists "image" among its input modalities', () => {
  assert.equal(modelSees({ data: [{ id: 'm', input_modalities: ['text', 'audio', 'image'] }] }), true);
  assert.equal(modelSees({ data: [{ id: 'm', input_modalities: ['text', 'audio'] }] }), false);
  assert.equal(modelSees({ data: [{ id: 'm' }] }), false, 'OpenAI lists no modalities');
  assert.equal(modelSees({ error: { message: 'Incorrect API key provided' } }), false);
  assert.equal(modelSees(null), false);
});
