/**
 * The page's glue: buttons and settings, the microphone, the camera or screen share (where the
 * server's model sees), the call (call.js), the level probes (meter.js) and the view (view.js)
 * around one client state (state.js).
 *
 * One call at a time. Its resources (the microphone stream, the video stream, the level probes,
 * the call and the level timer) live from Connect to hang-up or the call's end; `release()` frees
 * them all. The
 * AudioContext lives with the page: browsers let a page create it from a user gesture (Connect).
 *
 * `window.duplexClient.dispatch(event)` feeds an event to the page as if the server had sent it:
 * for automation and for trying the page from the console.
 */
import { CallError, startCall } from './call.js';
import { levelProbe } from './meter.js';
import {
  CAMERA_CONSTRAINTS, MESSAGES, MODELS_PATH, SCREEN_CONSTRAINTS, audioConstraints, authHeaders,
  describeMediaError, modelSees, sessionUpdate,
} from './protocol.js';
import { initialState, reduce } from './state.js';
import { createView } from './view.js';

// Meters and level hooks refresh at 20 Hz: smooth to the eye, cheap for the page.
const LEVEL_INTERVAL_MS = 50;
// The transcript's picture of what the agent saw in a turn: small, a JPEG.
const THUMBNAIL_WIDTH = 96;

const $ = (id) => document.getElementById(id);
const form = $('settings');
const micSelect = $('mic');
const remoteAudio = $('remote-audio');
const settingsNote = $('settings-note');
const videoControls = $('video-controls');
const cameraButton = $('camera');
const screenButton = $('screen');
const preview = $('preview');
const view = createView(document);

let state = initialState();
let call = null;
let micStream = null;
let videoStream = null; // the camera's or the screen's, while the user shares one
let videoSource = null; // 'camera' | 'screen'
let audioContext = null;
let levelTimer = null;
const probes = { local: null, remote: null };

function dispatch(event) {
  // The user's turn is in: what the camera shows now is what the agent saw with it.
  if (event.type === 'input_audio_buffer.committed' && videoStream !== null) {
    const url = snapshot();
    if (url !== null) view.addThumbnail(event.item_id, url);
  }
  state = reduce(state, event, performance.now());
  view.render(state);
}

function snapshot() {
  if (!preview.videoWidth) return null;
  const canvas = document.createElement('canvas');
  canvas.width = THUMBNAIL_WIDTH;
  canvas.height = Math.round((THUMBNAIL_WIDTH * preview.videoHeight) / preview.videoWidth);
  canvas.getContext('2d').drawImage(preview, 0, 0, canvas.width, canvas.height);
  return canvas.toDataURL('image/jpeg', 0.7);
}

/** Whether the server's model sees (its /v1/models says so); false when it cannot tell. */
async function serverSees(apiKey) {
  try {
    const response = await fetch(MODELS_PATH, { headers: authHeaders(apiKey) });
    return response.ok && modelSees(await response.json());
  } catch {
    return false;
  }
}

function drawVideoControls() {
  const live = call !== null;
  cameraButton.disabled = !live;
  screenButton.disabled = !live;
  cameraButton.setAttribute('aria-pressed', String(videoSource === 'camera'));
  screenButton.setAttribute('aria-pressed', String(videoSource === 'screen'));
  cameraButton.textContent = videoSource === 'camera' ? 'Stop my camera' : 'Show my camera';
  screenButton.textContent = videoSource === 'screen' ? 'Stop sharing' : 'Share my screen';
  preview.hidden = videoStream === null;
}

function stopVideo() {
  videoStream?.getTracks().forEach((track) => track.stop());
  videoStream = null;
  videoSource = null;
  preview.srcObject = null;
  drawVideoControls();
}

/** Shows the agent the camera or the screen (`source`), or stops showing it when it already does. */
async function toggleVideo(source) {
  if (call === null) return;
  const showing = videoSource;
  stopVideo();
  await call.setVideo(null);
  if (showing === source) return;
  try {
    videoStream = source === 'camera'
      ? await navigator.mediaDevices.getUserMedia({ video: CAMERA_CONSTRAINTS })
      : await navigator.mediaDevices.getDisplayMedia({ video: SCREEN_CONSTRAINTS });
  } catch (error) {
    dispatch({ type: 'client.error', message: describeMediaError(error) });
    return;
  }
  const track = videoStream.getVideoTracks()[0];
  // The browser's own "stop sharing" ends the track: the page follows.
  track.addEventListener('ended', () => {
    if (videoStream?.getVideoTracks()[0] === track) {
      stopVideo();
      call?.setVideo(null);
    }
  });
  videoSource = source;
  preview.srcObject = videoStream;
  await call.setVideo(track);
  drawVideoControls();
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
  stopVideo();
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
  const apiKey = form.elements.apiKey.value;
  const sees = await serverSees(apiKey);
  videoControls.hidden = !sees;
  try {
    call = await startCall({
      stream: micStream,
      apiKey,
      video: sees,
      onEvent: dispatch,
      onOpen(openedCall) {
        dispatch({ type: 'client.channel_open' });
        sendSettings(openedCall);
        drawVideoControls();
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
cameraButton.addEventListener('click', () => toggleVideo('camera'));
screenButton.addEventListener('click', () => toggleVideo('screen'));
micSelect.addEventListener('change', switchMicrophone);
navigator.mediaDevices?.addEventListener('devicechange', listMicrophones);
// Leaving the page hangs up (the hang-up request is keepalive), so the server frees the session now.
window.addEventListener('pagehide', () => call?.hangup());

window.duplexClient = { dispatch };
view.render(state);
listMicrophones();
