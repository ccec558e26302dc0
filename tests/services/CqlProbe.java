// Minimal CQL native-protocol (v4) client used by services.sh: readiness probe
// and `services.sh cql`. Plain JDK only, no driver. Not for production use.
//
//   java CqlProbe HOST PORT [STATEMENT...]
//
// With no statement it runs "SELECT release_version FROM system.local" and
// prints the version. Each statement is run in order on one connection; rows
// are printed one per line, cells separated by " | ", with a header line.
// Exit status: 0 ok, 1 server error, 2 connection/protocol error.

import java.io.ByteArrayOutputStream;
import java.io.DataInputStream;
import java.io.DataOutputStream;
import java.io.IOException;
import java.net.InetSocketAddress;
import java.net.Socket;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.UUID;

public final class CqlProbe {
    private static final int OP_ERROR = 0x00, OP_STARTUP = 0x01, OP_READY = 0x02,
            OP_AUTHENTICATE = 0x03, OP_QUERY = 0x07, OP_RESULT = 0x08;

    private final DataInputStream in;
    private final DataOutputStream out;
    private short stream = 0;

    private CqlProbe(Socket s) throws IOException {
        in = new DataInputStream(s.getInputStream());
        out = new DataOutputStream(s.getOutputStream());
    }

    public static void main(String[] args) {
        if (args.length < 2) {
            System.err.println("usage: CqlProbe HOST PORT [STATEMENT...]");
            System.exit(2);
        }
        String host = args[0];
        int port = Integer.parseInt(args[1]);
        List<String> stmts = new ArrayList<>();
        for (int i = 2; i < args.length; i++) stmts.add(args[i]);
        boolean probe = stmts.isEmpty();
        if (probe) stmts.add("SELECT release_version FROM system.local");
        int readTimeoutMs = Integer.getInteger("cqlprobe.timeout.ms", 30000);

        try (Socket s = new Socket()) {
            s.connect(new InetSocketAddress(host, port), 3000);
            s.setSoTimeout(readTimeoutMs);
            CqlProbe c = new CqlProbe(s);
            c.startup();
            for (String q : stmts) {
                ByteBuffer body = c.query(q);
                if (body == null) System.exit(1);
                c.printResult(body, probe);
            }
        } catch (IOException | RuntimeException e) {
            System.err.println("cql: " + host + ":" + port + ": " + e);
            System.exit(2);
        }
    }

    private void startup() throws IOException {
        ByteArrayOutputStream b = new ByteArrayOutputStream();
        DataOutputStream d = new DataOutputStream(b);
        d.writeShort(1);
        writeString(d, "CQL_VERSION");
        writeString(d, "3.0.0");
        Frame f = roundTrip(OP_STARTUP, b.toByteArray());
        if (f.opcode == OP_AUTHENTICATE) throw new IOException("server requires authentication");
        if (f.opcode == OP_ERROR) throw new IOException("STARTUP failed: " + errorText(f.body));
        if (f.opcode != OP_READY) throw new IOException("unexpected opcode " + f.opcode + " after STARTUP");
    }

    /** Returns the RESULT body, or null after printing a server error. */
    private ByteBuffer query(String q) throws IOException {
        ByteArrayOutputStream b = new ByteArrayOutputStream();
        DataOutputStream d = new DataOutputStream(b);
        byte[] qb = q.getBytes(StandardCharsets.UTF_8);
        d.writeInt(qb.length);
        d.write(qb);
        d.writeShort(0x0001); // consistency ONE (single node)
        d.writeByte(0);       // no query flags
        Frame f = roundTrip(OP_QUERY, b.toByteArray());
        if (f.opcode == OP_ERROR) {
            System.err.println("cql error: " + errorText(f.body));
            return null;
        }
        if (f.opcode != OP_RESULT) throw new IOException("unexpected opcode " + f.opcode + " after QUERY");
        return f.body;
    }

    private void printResult(ByteBuffer b, boolean probe) {
        int kind = b.getInt();
        switch (kind) {
            case 1: if (!probe) System.out.println("OK"); return;
            case 3: System.out.println("USE " + readString(b)); return;
            case 5: System.out.println("SCHEMA " + readString(b) + " " + readString(b) + " " + readString(b)); return;
            case 2: break;
            default: System.out.println("RESULT kind " + kind); return;
        }
        int flags = b.getInt();
        int ncols = b.getInt();
        if ((flags & 0x0002) != 0) readBytes(b); // paging state
        List<String> names = new ArrayList<>();
        List<Integer> types = new ArrayList<>();
        if ((flags & 0x0004) == 0) {
            boolean global = (flags & 0x0001) != 0;
            if (global) { readString(b); readString(b); }
            for (int i = 0; i < ncols; i++) {
                if (!global) { readString(b); readString(b); }
                names.add(readString(b));
                types.add(readOption(b));
            }
        }
        int nrows = b.getInt();
        if (!probe) System.out.println(String.join(" | ", names));
        for (int r = 0; r < nrows; r++) {
            StringBuilder line = new StringBuilder();
            for (int c = 0; c < ncols; c++) {
                if (c > 0) line.append(" | ");
                byte[] v = readBytes(b);
                line.append(format(types.isEmpty() ? -1 : types.get(c), v));
            }
            System.out.println(line);
        }
        if (!probe) System.out.println("(" + nrows + " rows)");
    }

    private static String format(int type, byte[] v) {
        if (v == null) return "null";
        ByteBuffer bb = ByteBuffer.wrap(v);
        switch (type) {
            case 0x0001: case 0x000D: return new String(v, StandardCharsets.UTF_8); // ascii, varchar
            case 0x0004: return v.length == 1 ? Boolean.toString(v[0] != 0) : hex(v);
            case 0x0009: return v.length == 4 ? Integer.toString(bb.getInt()) : hex(v);
            case 0x0002: case 0x0005: return v.length == 8 ? Long.toString(bb.getLong()) : hex(v); // bigint, counter
            case 0x000B: return v.length == 8 ? java.time.Instant.ofEpochMilli(bb.getLong()).toString() : hex(v);
            case 0x000C: case 0x000F: return v.length == 16 ? new UUID(bb.getLong(), bb.getLong()).toString() : hex(v);
            default: return hex(v);
        }
    }

    private static String hex(byte[] v) {
        StringBuilder sb = new StringBuilder("0x");
        for (byte x : v) sb.append(String.format("%02x", x));
        return sb.toString();
    }

    /** Reads a type [option]; returns its id (nested types are skipped). */
    private static int readOption(ByteBuffer b) {
        int id = b.getShort() & 0xffff;
        switch (id) {
            case 0x0000: readString(b); break;                      // custom
            case 0x0020: case 0x0022: readOption(b); break;         // list, set
            case 0x0021: readOption(b); readOption(b); break;       // map
            case 0x0030: {                                          // udt
                readString(b); readString(b);
                int n = b.getShort() & 0xffff;
                for (int i = 0; i < n; i++) { readString(b); readOption(b); }
                break;
            }
            case 0x0031: {                                          // tuple
                int n = b.getShort() & 0xffff;
                for (int i = 0; i < n; i++) readOption(b);
                break;
            }
            default: break;
        }
        return id;
    }

    private static final class Frame {
        int opcode;
        ByteBuffer body;
    }

    private Frame roundTrip(int opcode, byte[] body) throws IOException {
        short id = stream++;
        out.writeByte(0x04);
        out.writeByte(0);
        out.writeShort(id);
        out.writeByte(opcode);
        out.writeInt(body.length);
        out.write(body);
        out.flush();
        while (true) {
            int version = in.readUnsignedByte();
            int flags = in.readUnsignedByte();
            short rid = in.readShort();
            int op = in.readUnsignedByte();
            int len = in.readInt();
            if (len < 0 || len > (256 << 20)) throw new IOException("bad frame length " + len);
            byte[] data = new byte[len];
            in.readFully(data);
            if ((version & 0x7f) != 0x04) {
                throw new IOException("server answered protocol version " + (version & 0x7f));
            }
            if (rid != id) continue; // events or stale responses
            ByteBuffer bb = ByteBuffer.wrap(data);
            if ((flags & 0x01) != 0) throw new IOException("unexpected compressed frame");
            if ((flags & 0x02) != 0) bb.position(bb.position() + 16); // tracing id
            if ((flags & 0x08) != 0) {                                  // warnings
                int n = bb.getShort() & 0xffff;
                for (int i = 0; i < n; i++) System.err.println("cql warning: " + readString(bb));
            }
            if ((flags & 0x04) != 0) {                                  // custom payload
                int n = bb.getShort() & 0xffff;
                for (int i = 0; i < n; i++) { readString(bb); readBytes(bb); }
            }
            Frame f = new Frame();
            f.opcode = op;
            f.body = bb.slice();
            return f;
        }
    }

    private static String errorText(ByteBuffer b) {
        int code = b.getInt();
        return String.format("0x%04x %s", code, readString(b));
    }

    private static void writeString(DataOutputStream d, String s) throws IOException {
        byte[] x = s.getBytes(StandardCharsets.UTF_8);
        d.writeShort(x.length);
        d.write(x);
    }

    private static String readString(ByteBuffer b) {
        int n = b.getShort() & 0xffff;
        byte[] x = new byte[n];
        b.get(x);
        return new String(x, StandardCharsets.UTF_8);
    }

    private static byte[] readBytes(ByteBuffer b) {
        int n = b.getInt();
        if (n < 0) return null;
        byte[] x = new byte[n];
        b.get(x);
        return x;
    }
}
