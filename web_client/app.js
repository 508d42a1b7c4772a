/**
 * The page's glue: buttons and settings, the microphone, the call (call.js), the level probes
 * (meter.js) and the view (view.js) around one client state (state.js).
 *
 * One call at a time. Its resources (the microphone stream, the level probes, the call and the
 * level timer) live from Connect to hang-up or the call's end; `release()` frees them all. The
 * AudioContext lives with the page: browsers let a page create it from a user gesture (Connect).
 *
 * `window.duplexClient.dispatch(event)` feeds an event to the page as if the server had sent it:
 * for automation and for trying the page from the console.
 */
import { CallError, startCall } from './call.js';
import { levelProbe } from './meter.js';
import { MESSAGES, audioConstraints, describeMediaError, sessionUpdate } from './protocol.js';
import { initialState, reduce } from './state.js';
import { createView } from './view.js';

// Meters and level hooks refresh at 20 Hz: smooth to the eye, cheap for the page.
const LEVEL_INTERVAL_MS = 50;

const $ = (id) => document.getElementById(id);
const form = $('settings');
const micSelect = $('mic');
const remoteAudio = $('remote-audio');
const settingsNote = $('settings-note');
const view = createView(document);

let state = initialState();
let call = null;
let micStream = null;
let audioContext = null;
let levelTimer = null;
const probes = { local: null, remote: null };

function dispatch(event) {
  state = reduce(state, event, performance.now());
  view.render(state);
}

function settings() {
  const fields = form.elements;
  return {
    instructions: fields.instructions.value,
    voice: fields.voice.value,
    turnDetection: fields.turnDetection.value,
    eagerness: fields.eagerness.value,
    vadThreshold: fields.vadThreshold.valueAsNumber,
    silenceDurationMs: fields.silenceDurationMs.valueAsNumber,
  };
}

function settingsValid() {
  if (form.checkValidity()) return true;
  form.closest('details').open = true;
  form.reportValidity();
  return false;
}

function openMicrophone() {
  const fields = form.elements;
  return navigator.mediaDevices.getUserMedia({
    audio: audioConstraints({
      deviceId: micSelect.value,
      echoCancellation: fields.echoCancellation.checked,
      noiseSuppression: fields.noiseSuppression.checked,
      autoGainControl: fields.autoGainControl.checked,
    }),
  });
}

async function listMicrophones() {
  if (!navigator.mediaDevices?.enumerateDevices) return;
  const devices = await navigator.mediaDevices.enumerateDevices();
  const chosen = micSelect.value;
  // Until the first permission the browser hides ids and labels: only the default is offered then.
  const mics = devices.filter((d) => d.kind === 'audioinput' && d.deviceId && d.deviceId !== 'default');
  micSelect.replaceChildren(
    new Option('Default microphone', ''),
    ...mics.map((mic, index) => new Option(mic.label || `Microphone ${index + 1}`, mic.deviceId)),
  );
  micSelect.value = mics.some((mic) => mic.deviceId === chosen) ? chosen : '';
}

function setProbe(name, stream) {
  probes[name]?.disconnect();
  probes[name] = stream ? levelProbe(audioContext, stream) : null;
}

function drawLevels() {
  view.renderLevels(probes.local?.level() ?? 0, probes.remote?.level() ?? 0);
}

/** Frees everything the call held; the page is ready for the next Connect. */
function release() {
  clearInterval(levelTimer);
  levelTimer = null;
  setProbe('local', null);
  setProbe('remote', null);
  micStream?.getTracks().forEach((track) => track.stop());
  micStream = null;
  remoteAudio.srcObject = null;
  call = null;
  drawLevels();
}

function fail(message) {
  release();
  dispatch({ type: 'client.failed', message });
}

function sendSettings(target) {
  target.send(sessionUpdate(settings()));
}

async function connect() {
  if (!settingsValid()) return;
  dispatch({ type: 'client.connecting' });
  if (!navigator.mediaDevices?.getUserMedia) {
    fail(MESSAGES.insecureContext);
    return;
  }
  audioContext ??= new AudioContext();
  // Not awaited: a context the browser keeps suspended must not hold up the call, only the meters.
  audioContext.resume().catch((error) => console.warn('duplex: audio context suspended', error));
  try {
    micStream = await openMicrophone();
  } catch (error) {
    fail(describeMediaError(error));
    return;
  }
  listMicrophones();
  setProbe('local', micStream);
  levelTimer = setInterval(drawLevels, LEVEL_INTERVAL_MS);
  try {
    call = await startCall({
      stream: micStream,
      apiKey: form.elements.apiKey.value,
      onEvent: dispatch,
      onOpen(openedCall) {
        dispatch({ type: 'client.channel_open' });
        sendSettings(openedCall);
      },
      onRemoteStream(stream) {
        remoteAudio.srcObject = stream;
        remoteAudio.play().catch((error) => console.warn('duplex: remote audio blocked', error));
        setProbe('remote', stream);
      },
      onEnd({ failed, message }) {
        release();
        dispatch(failed ? { type: 'client.failed', message } : { type: 'client.channel_closed' });
      },
    });
  } catch (error) {
    fail(error instanceof CallError ? error.message : `The call could not start (${error.message}).`);
  }
}

function hangup() {
  call?.hangup();
  release();
  dispatch({ type: 'client.hangup' });
}

async function switchMicrophone() {
  if (call === null) return;
  try {
    const next = await openMicrophone();
    await call.replaceTrack(next.getAudioTracks()[0]);
    micStream.getTracks().forEach((track) => track.stop());
    micStream = next;
    setProbe('local', micStream);
  } catch (error) {
    dispatch({ type: 'client.error', message: describeMediaError(error) });
  }
}

form.addEventListener('submit', (event) => {
  event.preventDefault();
  if (!settingsValid()) return;
  if (call !== null && state.connection === 'connected') {
    sendSettings(call);
    settingsNote.textContent = 'Sent to the agent.';
  } else {
    settingsNote.textContent = 'Saved: they go to the agent when the call starts.';
  }
});
$('connect').addEventListener('click', connect);
$('hangup').addEventListener('click', hangup);
micSelect.addEventListener('change', switchMicrophone);
navigator.mediaDevices?.addEventListener('devicechange', listMicrophones);
// Leaving the page hangs up (the hang-up request is keepalive), so the server frees the session now.
window.addEventListener('pagehide', () => call?.hangup());

window.duplexClient = { dispatch };
view.render(state);
listMicrophones();
