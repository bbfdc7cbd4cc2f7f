package registrar

import (
	"context"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/podres"
)

// KubeletView is what kubelet's pod-resources API says of a device plugin's resource.
type KubeletView struct {
	// Devices counts the resource's allocatable devices that kubelet's device manager holds.
	Devices int
	// ReadAt is when kubelet said so.
	ReadAt time.Time
	// Since is since when kubelet has held that many, as far as multireg has read.
	Since time.Time
	// Missing is set when the driver is registered and kubelet, which has held devices of its
	// resource, has held none for longer than a reconcile pass: kubelet dropped the resource,
	// or the plugin reports no healthy device. A plugin never seen with a device (one that
	// runs on nodes without its hardware) is not missing anything.
	Missing bool
}

// PodResources is what the instance knows of kubelet's pod-resources API, for /status: where
// it reads it, whether it answers, and how a device plugin's new instance is registered now.
type PodResources struct {
	// Socket is the API's socket as this process reads it.
	Socket string
	// Answers: kubelet's API answers; without it no device plugin's resource is shown, and
	// no move is verified.
	Answers bool
	// DevicePluginMoves is how a device plugin's new instance is registered now: "beside" the
	// running one, or "in place" of its registration (what the --device-plugin-moves setting,
	// kubelet's view and what was learnt of its device manager make of it).
	DevicePluginMoves string
}

// PodResources says what the instance knows of kubelet's pod-resources API; ok is false when
// it reads none (--pod-resources-socket empty).
func (s *Supervisor) PodResources() (PodResources, bool) {
	v := s.env.moves.view
	if v == nil {
		return PodResources{}, false
	}
	p := PodResources{Socket: v.Path(), Answers: v.Available(), DevicePluginMoves: "in place"}
	if s.env.moves.beside() {
		p.DevicePluginMoves = "beside"
	}
	return p, true
}

// kubeletView is what reading r says of a device plugin's resource, for its status st.
func kubeletView(r podres.Reading, st DriverStatus) *KubeletView {
	n, since, ok := r.Count(st.Name)
	if !ok {
		return nil
	}
	from := since // the resource has had n devices since from, and the driver its phase since st.Since
	if st.Since.After(from) {
		from = st.Since
	}
	registeredFor := r.At.Sub(from)
	missing := st.Phase == Registered && n == 0 && registeredFor > podres.Period && !r.HadAt(st.Name).IsZero()
	return &KubeletView{Devices: n, ReadAt: r.At, Since: since, Missing: missing}
}

// watchKubelet logs, once a reconcile pass, each registered device plugin whose resource
// kubelet holds no device of (KubeletView.Missing), when that begins and when it ends, until
// ctx ends. It reads only the device plugins' phases, and nothing while kubelet's view does
// not answer.
func (s *Supervisor) watchKubelet(ctx context.Context) {
	if s.env.moves.view == nil {
		return
	}
	t := time.NewTicker(podres.Period)
	defer t.Stop()
	missing := map[string]bool{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r, up := s.env.moves.view.Last()
		if !up {
			continue
		}
		s.mu.Lock()
		var dps []*driver
		for _, h := range s.running {
			if h.d.spec.Type == config.DevicePlugin {
				dps = append(dps, h.d)
			}
		}
		s.mu.Unlock()
		seen := make(map[string]bool, len(dps))
		for _, d := range dps {
			d.mu.Lock()
			st := DriverStatus{Name: d.st.Name, Phase: d.st.Phase, Since: d.st.Since}
			d.mu.Unlock()
			kv := kubeletView(r, st)
			seen[st.Name] = true
			switch m := kv.Missing; {
			case m && !missing[st.Name]:
				s.log.Warn("kubelet holds no device of the registered device plugin's resource", "driver", st.Name,
					"for", kv.ReadAt.Sub(kv.Since).Round(time.Millisecond).String())
			case !m && missing[st.Name]:
				s.log.Info("kubelet holds the device plugin's devices again", "driver", st.Name, "devices", kv.Devices)
			}
			missing[st.Name] = kv.Missing
		}
		for name := range missing {
			if !seen[name] {
				delete(missing, name)
			}
		}
	}
}
