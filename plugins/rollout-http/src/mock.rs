//! A scriptable HTTP/1.1 server for protocol tests (feature `mock`): every request is recorded,
//! and a handler chooses each answer — a JSON body with a status, a dropped connection, a delay.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

/// A request the mock received.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub method: String,
    /// Path and query, e.g. `/pause?mode=wait`.
    pub path: String,
    /// The body as JSON (`null` when empty, a string when not JSON).
    pub body: Value,
}

/// How the mock answers one request.
#[derive(Debug, Clone)]
pub enum Reply {
    Json(u16, Value),
    Text(u16, String),
    /// Close the connection without answering, as a crashing server does.
    Drop,
    /// Answer after a pause.
    After(Duration, Box<Reply>),
}

impl Reply {
    pub fn ok(body: Value) -> Self {
        Self::Json(200, body)
    }
}

type Handler = dyn Fn(&Recorded) -> Reply + Send + Sync;

pub struct MockServer {
    url: String,
    requests: Arc<Mutex<Vec<Recorded>>>,
    stop: Arc<AtomicBool>,
}

impl MockServer {
    pub fn start(handler: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding the mock server");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let handler: Arc<Handler> = Arc::new(handler);
        let (seen, stopped) = (requests.clone(), stop.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (seen, handler) = (seen.clone(), handler.clone());
                std::thread::spawn(move || serve(stream, &seen, &*handler));
            }
        });
        Self {
            url,
            requests,
            stop,
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }

    /// The requests to `path` (query ignored).
    pub fn requests_to(&self, path: &str) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.path.split('?').next() == Some(path))
            .collect()
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.url.trim_start_matches("http://"));
    }
}

fn serve(stream: TcpStream, seen: &Mutex<Vec<Recorded>>, handler: &Handler) {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() || line.is_empty() {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or("").to_owned(),
        parts.next().unwrap_or("").to_owned(),
    );
    let mut length = 0usize;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let text = String::from_utf8_lossy(&body).into_owned();
    let body = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    let request = Recorded { method, path, body };
    seen.lock().unwrap().push(request.clone());
    let mut reply = handler(&request);
    while let Reply::After(pause, next) = reply {
        std::thread::sleep(pause);
        reply = *next;
    }
    let (status, text) = match reply {
        Reply::Json(status, value) => (status, value.to_string()),
        Reply::Text(status, text) => (status, text),
        Reply::Drop | Reply::After(..) => return,
    };
    let mut stream = reader.into_inner();
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
}
