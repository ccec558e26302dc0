// jetstream-bench: the JetStream reference for bench/cpu-per-message.sh.
// It publishes -messages messages at -rate per second (open loop) to a stream
// with a duplicate window, each with a Nats-Msg-Id header, -resend-share of
// them resends of an earlier ID, with at most -in-flight publishes awaiting
// their PubAck. It prints one JSON line: publishes, acknowledged, caught as
// duplicates, elapsed seconds, ACK latency percentiles and its own CPU.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
)

func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}

func main() {
	url := flag.String("url", nats.DefaultURL, "nats-server URL")
	messages := flag.Int("messages", 10000, "publishes in all, resends included")
	rate := flag.Float64("rate", 1000, "publishes per second")
	resendShare := flag.Float64("resend-share", 0.11, "share of publishes that resend an earlier ID")
	inFlight := flag.Int("in-flight", 256, "publishes awaiting their PubAck at most")
	bodyBytes := flag.Int("body-bytes", 60, "body size")
	window := flag.Duration("duplicate-window", 2*time.Minute, "the stream's duplicate window")
	stream := flag.String("stream", "IMDEDUP_BENCH", "stream name (created anew)")
	seed := flag.Int64("seed", 1, "random seed")
	handshake := flag.Bool("handshake", false, "print \"ready\" once the stream exists and wait for a line on stdin "+
		"before publishing, and for another after the report before deleting the stream (so a caller can read "+
		"the server's CPU around the publishes alone)")
	flag.Parse()
	stdin := bufio.NewReader(os.Stdin)
	wait := func() {
		if *handshake {
			_, _ = stdin.ReadString('\n')
		}
	}

	nc, err := nats.Connect(*url)
	if err != nil {
		fail("connect: %v", err)
	}
	defer nc.Close()
	js, err := nc.JetStream(nats.PublishAsyncMaxPending(*inFlight))
	if err != nil {
		fail("jetstream: %v", err)
	}
	_ = js.DeleteStream(*stream)
	subject := strings.ToLower(*stream) + ".msgs"
	if _, err := js.AddStream(&nats.StreamConfig{
		Name:       *stream,
		Subjects:   []string{subject},
		Storage:    nats.FileStorage,
		Duplicates: *window,
	}); err != nil {
		fail("add stream: %v", err)
	}

	rng := rand.New(rand.NewSource(*seed))
	body := []byte(strings.Repeat("x", max(*bodyBytes, 1)))
	ids := make([]string, 0, *messages)
	for i := 0; i < *messages; i++ {
		if len(ids) > 0 && rng.Float64() < *resendShare {
			ids = append(ids, ids[rng.Intn(len(ids))])
		} else {
			ids = append(ids, fmt.Sprintf("%016x%016x", rng.Uint64(), rng.Uint64()))
		}
	}

	if *handshake {
		fmt.Println("ready")
	}
	wait()
	latencies := make([]time.Duration, *messages)
	var acked, duplicates, errors int64
	var mu sync.Mutex
	var wg sync.WaitGroup
	cpuBefore := cpuSeconds()
	started := time.Now()
	for i, id := range ids {
		due := started.Add(time.Duration(float64(i) / *rate * float64(time.Second)))
		if d := time.Until(due); d > 0 {
			time.Sleep(d)
		}
		msg := nats.NewMsg(subject)
		msg.Header.Set(nats.MsgIdHdr, id)
		msg.Data = body
		future, err := js.PublishMsgAsync(msg)
		if err != nil {
			mu.Lock()
			errors++
			mu.Unlock()
			continue
		}
		wg.Add(1)
		go func(i int, due time.Time) {
			defer wg.Done()
			select {
			case ack := <-future.Ok():
				mu.Lock()
				acked++
				if ack.Duplicate {
					duplicates++
				}
				latencies[i] = time.Since(due)
				mu.Unlock()
			case <-future.Err():
				mu.Lock()
				errors++
				mu.Unlock()
			}
		}(i, due)
	}
	wg.Wait()
	elapsed := time.Since(started).Seconds()
	cpu := cpuSeconds() - cpuBefore

	got := make([]float64, 0, len(latencies))
	for _, l := range latencies {
		if l > 0 {
			got = append(got, float64(l.Microseconds())/1000)
		}
	}
	sort.Float64s(got)
	q := func(p float64) float64 {
		if len(got) == 0 {
			return 0
		}
		return got[int(float64(len(got)-1)*p+0.5)]
	}
	_ = json.NewEncoder(os.Stdout).Encode(map[string]any{
		"publishes":          *messages,
		"acknowledged":       acked,
		"duplicates":         duplicates,
		"errors":             errors,
		"seconds":            elapsed,
		"acknowledged_per_s": float64(acked) / elapsed,
		"p50_ms":             q(0.5),
		"p99_ms":             q(0.99),
		"client_cpu_seconds": cpu,
	})
	wait()
	_ = js.DeleteStream(*stream)
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "jetstream-bench: "+format+"\n", args...)
	os.Exit(1)
}
