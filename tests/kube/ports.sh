# Sourced by the kube scripts (e2e.sh, single-node.sh).

# N distinct loopback ports nothing listens on, on one line: all bound at
# once, so no two are the same (ports asked for one at a time can be).
free_ports() {
  python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}
