/**
 * One WebRTC call to a duplex server (or any OpenAI Realtime WebRTC server), as CONTRACT.md says:
 * the SDP offer is POSTed to /v1/realtime/calls, events travel on the `oai-events` data channel,
 * and POST /v1/realtime/calls/{call_id}/hangup ends it.
 *
 * A call owns its RTCPeerConnection and data channel from `startCall` until `hangup()` or its end
 * (`onEnd` fires at most once: ICE failure, connect timeout, or the server closing the channel).
 * It does not own the microphone stream: the page opened it and stops it.
 */
import {
  CALLS_PATH, ICE_SERVERS_PATH, MESSAGES, authHeaders, callIdFromLocation, describeHttpError,
  describeUnreachable, hangupPath,
} from './protocol.js';

/** A call that could not start; its message is meant for the user. */
export class CallError extends Error {}

// The offer carries its candidates: an answer-only HTTP exchange leaves no way to trickle more.
const GATHERING_TIMEOUT_MS = 3000;
// A server that accepted the TCP connection but never answers must not leave the page connecting.
const ANSWER_TIMEOUT_MS = 15000;
// ICE over a reachable path takes well under a second; past this the path is not there.
const CONNECT_TIMEOUT_MS = 15000;
// The ICE server list is a small JSON answer; a server that cannot give it soon offers none.
const ICE_SERVERS_TIMEOUT_MS = 5000;

function gatheringComplete(pc) {
  return new Promise((resolve) => {
    const finish = () => {
      clearTimeout(timer);
      pc.removeEventListener('icegatheringstatechange', check);
      resolve();
    };
    const check = () => {
      if (pc.iceGatheringState === 'complete') finish();
    };
    // Past the timeout the offer goes with the candidates gathered so far.
    const timer = setTimeout(finish, GATHERING_TIMEOUT_MS);
    pc.addEventListener('icegatheringstatechange', check);
    check();
  });
}

/**
 * The STUN/TURN servers the server offers (its --ice-server), in RTCIceServer shape; none when it
 * offers none or cannot say (an older server, another Realtime server): never a public server.
 */
async function offeredIceServers(apiKey) {
  try {
    const response = await fetch(ICE_SERVERS_PATH, {
      headers: authHeaders(apiKey), signal: AbortSignal.timeout(ICE_SERVERS_TIMEOUT_MS),
    });
    if (!response.ok) return [];
    const body = await response.json();
    return Array.isArray(body?.ice_servers) ? body.ice_servers : [];
  } catch {
    return [];
  }
}

/** POSTs the offer; returns the answer SDP and the call id, or throws a CallError for the user. */
async function exchangeOffer(offerSdp, apiKey) {
  let response;
  try {
    response = await fetch(CALLS_PATH, {
      method: 'POST',
      headers: { 'Content-Type': 'application/sdp', ...authHeaders(apiKey) },
      body: offerSdp,
      signal: AbortSignal.timeout(ANSWER_TIMEOUT_MS),
    });
  } catch (error) {
    throw new CallError(error?.name === 'TimeoutError'
      ? MESSAGES.noAnswer
      : describeUnreachable(new URL(CALLS_PATH, window.location.href).origin));
  }
  const body = await response.text();
  if (!response.ok) {
    throw new CallError(describeHttpError(response.status, body, response.headers.get('Retry-After')));
  }
  return { answerSdp: body, callId: callIdFromLocation(response.headers.get('Location')) };
}

/**
 * Starts a call sending `stream`'s audio and, with `video`, offering a video stream (a camera or
 * a screen share, attached and detached later with setVideo: no renegotiation). Callbacks:
 * onEvent(serverEvent), onOpen(call) when the data channel opens, onRemoteStream(MediaStream) for
 * the agent's audio, onEnd({failed, message}).
 * Resolves to {send(event), replaceTrack(track), setVideo(track), hangup()}; rejects with a CallError.
 */
export async function startCall({ stream, apiKey, video = false, onEvent, onOpen, onRemoteStream, onEnd }) {
  // The server's own STUN/TURN servers, if it has any: never a public STUN server implicitly.
  const pc = new RTCPeerConnection({ iceServers: await offeredIceServers(apiKey) });
  let ended = false;
  let connectTimer = null;
  let callId = null;

  const close = () => {
    ended = true;
    clearTimeout(connectTimer);
    pc.close();
  };
  const end = (info) => {
    if (ended) return;
    close();
    onEnd(info);
  };

  const channel = pc.createDataChannel('oai-events');
  const call = {
    send(event) {
      if (channel.readyState !== 'open') return false;
      channel.send(JSON.stringify(event));
      return true;
    },
    replaceTrack(track) {
      const audio = pc.getTransceivers().find((t) => t.receiver.track.kind === 'audio');
      return audio.sender.replaceTrack(track);
    },
    /** Sends `track` (a camera's or a screen's) as the call's video; null sends none. */
    setVideo(track) {
      if (camera === null) return Promise.reject(new Error('this call offers no video'));
      return camera.sender.replaceTrack(track);
    },
    /** Tells the server (keepalive: it survives the page closing) and closes the connection. */
    hangup() {
      if (ended) return;
      close();
      if (callId === null) return;
      fetch(hangupPath(callId), { method: 'POST', headers: authHeaders(apiKey), keepalive: true })
        .catch((error) => console.warn('duplex: hang-up request failed', error));
    },
  };

  for (const track of stream.getAudioTracks()) pc.addTrack(track, stream);
  // Sent from the first picture the user shares; the server answers it only if its model sees.
  const camera = video ? pc.addTransceiver('video', { direction: 'sendonly' }) : null;
  pc.addEventListener('track', (event) => {
    onRemoteStream(event.streams[0] ?? new MediaStream([event.track]));
  });
  channel.addEventListener('open', () => onOpen(call));
  channel.addEventListener('message', (message) => {
    let event;
    try {
      event = JSON.parse(message.data);
    } catch {
      console.warn('duplex: ignoring a data channel message that is not JSON', message.data);
      return;
    }
    onEvent(event);
  });
  channel.addEventListener('close', () => end({ failed: false }));
  pc.addEventListener('connectionstatechange', () => {
    if (pc.connectionState === 'failed') end({ failed: true, message: MESSAGES.iceFailed });
  });

  try {
    await pc.setLocalDescription(await pc.createOffer());
    await gatheringComplete(pc);
    const answer = await exchangeOffer(pc.localDescription.sdp, apiKey);
    callId = answer.callId;
    try {
      await pc.setRemoteDescription({ type: 'answer', sdp: answer.answerSdp });
    } catch {
      throw new CallError(MESSAGES.badAnswer);
    }
  } catch (error) {
    close();
    throw error;
  }
  connectTimer = setTimeout(() => {
    if (pc.connectionState !== 'connected') end({ failed: true, message: MESSAGES.connectTimeout });
  }, CONNECT_TIMEOUT_MS);

  return call;
}
